/* test_chat_template.c — conversations to prompt text (core/chat_template.c):
 * the named families' exact output, choosing a family for a model's
 * template, forcing one by name, and bad conversations. */
#include "duet.h"
#include "test_util.h"

/* Loads a family by name. */
static duet_chat_template *family(const char *name) {
    duet_chat_template *t = NULL;
    ck_assert_msg(duet_chat_template_load(NULL, name, &t) == DUET_OK, "%s: %s", name, duet_last_error());
    ck_assert_str_eq(duet_chat_template_name(t), name);
    ck_assert_str_eq(duet_chat_template_fallback_reason(t), "");
    return t;
}

static char *render(const duet_chat_template *t, const char *conv, bool gen) {
    char *out = NULL;
    ck_assert_msg(duet_chat_template_apply(t, conv, gen, &out) == DUET_OK, "%s", duet_last_error());
    return out;
}

START_TEST(family_for_model_template) {
    static const struct {
        const char *tmpl;
        const char *want;
    } cases[] = {
        {NULL, "plain"},
        {"", "plain"},
        {"{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
         "'<|im_end|>' + '\\n'}}{% endfor %}",
         "chatml"},
        {"{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
         "'<|end_header_id|>\\n\\n' + "
         "m['content'] | trim + '<|eot_id|>' }}{% endfor %}",
         "llama3"},
        {"{% if messages[0]['role'] == 'system' %}{% set system_message = '<<SYS>>\\n' + "
         "messages[0]['content'] "
         "+ '\\n<</SYS>>\\n\\n' %}{% endif %}{{ bos_token + '[INST] ' + content + ' [/INST]' }}",
         "llama2"},
        {"{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
         "message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}{% endif %}{% "
         "endfor %}",
         "mistral"},
        {"{% for message in messages %}{% if message['role'] == 'user' %}{{ '<|user|>\\n' + "
         "message['content'] + "
         "eos_token }}{% endif %}{% endfor %}{{ '<|assistant|>' }}",
         "zephyr"},
        {"{% for message in messages %}{{'<|' + message['role'] + '|>' + '\\n' + message['content'] + "
         "'<|end|>\\n' }}{% endfor %}<|user|>",
         "phi3"},
        {"{{ bos_token }}{% for message in messages %}{{ '<start_of_turn>' + role + '\\n' + "
         "message['content'] | "
         "trim + '<end_of_turn>\\n' }}{% endfor %}",
         "gemma"},
        {"{% for m in messages %}### {{ m['role'] }}: {{ m['content'] }}{% endfor %}", "plain"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        duet_chat_template *t = NULL;
        ck_assert_int_eq(duet_chat_template_parse(cases[i].tmpl, "<s>", "</s>", &t), DUET_OK);
        /* A template duet runs as written is named "jinja"; one it cannot
         * falls back to a family and says why. */
        const char *name = duet_chat_template_name(t);
        if (strcmp(name, "jinja")) {
            ck_assert_msg(!strcmp(name, cases[i].want), "template #%zu: %s, want %s", i, name, cases[i].want);
            ck_assert_msg(duet_chat_template_fallback_reason(t)[0],
                          "template #%zu fell back without a reason", i);
        }
        duet_chat_template_free(t);
    }
    duet_chat_template *t = NULL;
    ck_assert_int_eq(duet_chat_template_load(NULL, "no-such-family-or-file", &t), DUET_INVALID_ARGUMENT);
    ck_assert_ptr_null(t);
    ck_assert_msg(strstr(duet_last_error(), "chatml") != NULL, "the error lists the families: %s",
                  duet_last_error());
}
END_TEST

START_TEST(family_rendering) {
    const char *conv =
        "{\"messages\": [{\"role\": \"system\", \"content\": \"Be kind.\"},"
        "{\"role\": \"user\", \"content\": \"Hi \"},"
        "{\"role\": \"assistant\", \"content\": \"Hello!\"},"
        "{\"role\": \"user\", \"content\": [{\"type\": \"text\", \"text\": \"Tell a story.\"}]}]}";
    static const struct {
        const char *name, *want;
    } cases[] = {
        {"plain", "Be kind.\n\nUser: Hi \nAssistant: Hello!\nUser: Tell a story.\nAssistant:"},
        {"chatml", "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nHi <|im_end|>\n"
                   "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nTell a story.<|im_end|>\n"
                   "<|im_start|>assistant\n"},
        {"llama3", "<|start_header_id|>system<|end_header_id|>\n\nBe kind.<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
                   "<|start_header_id|>user<|end_header_id|>\n\nTell a story.<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n"},
        {"llama2",
         "[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Tell a story. [/INST]"},
        {"mistral", "[INST] Be kind.\n\nHi [/INST] Hello!</s><s>[INST] Tell a story. [/INST]"},
        {"zephyr", "<|system|>\nBe kind.</s>\n<|user|>\nHi </s>\n<|assistant|>\nHello!</s>\n<|user|>\n"
                   "Tell a story.</s>\n<|assistant|>\n"},
        {"phi3", "<|system|>\nBe kind.<|end|>\n<|user|>\nHi <|end|>\n<|assistant|>\nHello!<|end|>\n<|user|>\n"
                 "Tell a story.<|end|>\n<|assistant|>\n"},
        {"gemma",
         "<start_of_turn>user\nBe kind.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
         "<start_of_turn>user\nTell a story.<end_of_turn>\n<start_of_turn>model\n"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        duet_chat_template *t = family(cases[i].name);
        char *out = render(t, conv, true);
        ck_assert_msg(!strcmp(out, cases[i].want), "%s rendered\n[%s]\nwant\n[%s]", cases[i].name, out,
                      cases[i].want);
        free(out);
        duet_chat_template_free(t);
    }
    /* A lone system prompt still reaches families without a system role. */
    const char *sys_only = "{\"messages\": [{\"role\": \"system\", \"content\": \"Rules.\"}]}";
    static const char *const no_system_role[] = {"gemma", "mistral", "llama2"};
    for (int i = 0; i < 3; i++) {
        duet_chat_template *t = family(no_system_role[i]);
        char *out = render(t, sys_only, true);
        ck_assert_msg(strstr(out, "Rules.") != NULL, "%s dropped a lone system prompt: %s", no_system_role[i],
                      out);
        free(out);
        duet_chat_template_free(t);
    }
    /* Without add_generation_prompt the text ends with the last turn. */
    duet_chat_template *t = family("chatml");
    char *out = render(t, conv, false);
    ck_assert_msg(strlen(out) > 24 && !strcmp(out + strlen(out) - 24, "Tell a story.<|im_end|>\n"),
                  "chatml without the generation prompt: %s", out);
    free(out);
    ck_assert_str_eq(duet_chat_template_stops(t)[0], "<|im_end|>");
    duet_chat_template_free(t);
    t = family("plain");
    ck_assert_str_eq(duet_chat_template_stops(t)[0], "\nUser:");
    duet_chat_template_free(t);
    t = family("llama2");
    ck_assert_ptr_null(duet_chat_template_stops(t)[0]);
    duet_chat_template_free(t);
}
END_TEST

START_TEST(bad_conversations) {
    duet_chat_template *t = family("chatml");
    static const char *const bad[] = {
        "not json",
        "[]",
        "{\"messages\": 3}",
        "{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}",
        "{\"messages\": [{\"role\": \"user\", \"content\": 7}]}",
        "{\"messages\": [{\"role\": \"user\", \"content\": [{\"type\": \"image_url\"}]}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        char *out = (char *)"unchanged";
        duet_status st = duet_chat_template_apply(t, bad[i], true, &out);
        ck_assert_msg(st != DUET_OK, "accepted %s", bad[i]);
        ck_assert_msg(out == NULL, "output left behind for %s", bad[i]);
        ck_assert_msg(duet_last_error()[0], "no message for %s", bad[i]);
    }
    duet_chat_template_free(t);
}
END_TEST

/* A model's own Jinja template runs as written; a family is still forced by
 * name; a template duet cannot run falls back to its family with the reason. */
START_TEST(model_jinja_template) {
    duet_open_params op = duet_open_params_default();
    op.vocab_only = true;
    duet_model *m = NULL;
    ck_assert_msg(duet_model_open(test_shared_path("models/smollm2-135m-instruct-q4_k_m.gguf"), &op, &m) ==
                      DUET_OK,
                  "open: %s", duet_last_error());
    const char *conv = "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}]}";
    duet_chat_template *t = NULL;
    ck_assert_msg(duet_chat_template_load(m, NULL, &t) == DUET_OK, "%s", duet_last_error());
    ck_assert_str_eq(duet_chat_template_name(t), "jinja");
    ck_assert_str_eq(duet_chat_template_fallback_reason(t), "");
    char *out = render(t, conv, true);
    /* SmolLM2's template adds its own system prompt, which no family knows. */
    ck_assert_str_eq(out,
                     "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
                     "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    ck_assert_str_eq(duet_chat_template_stops(t)[0], "<|im_end|>");
    duet_chat_template_free(t);
    ck_assert_int_eq(duet_chat_template_load(m, "chatml", &t), DUET_OK);
    out = render(t, conv, true);
    ck_assert_str_eq(out, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    duet_chat_template_free(t);
    duet_model_close(m);

    /* Command R's template writes bos_token first: the text leaves it out
     * when tokenizing with add_special adds it, as the families do. */
    ck_assert_msg(duet_model_open(test_shared_path("models/ggml-vocab-command-r.gguf"), &op, &m) == DUET_OK,
                  "open: %s", duet_last_error());
    ck_assert_msg(duet_chat_template_load(m, "auto", &t) == DUET_OK, "%s", duet_last_error());
    ck_assert_str_eq(duet_chat_template_name(t), "jinja");
    out = render(t, conv, true);
    duet_model_desc d;
    duet_model_describe(m, &d);
    const char *bos = "<BOS_TOKEN>"; /* Command R's BOS text */
    ck_assert_msg((strncmp(out, bos, strlen(bos)) != 0) == d.add_bos, "add_bos %d: %s", d.add_bos, out);
    ck_assert_msg(strstr(out, "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi<|END_OF_TURN_TOKEN|>"), "%s", out);
    free(out);
    duet_chat_template_free(t);
    duet_model_close(m);

    /* Jinja files: one that runs, one with a tag duet lacks, one that fails
     * on the probe conversation. */
    static const struct {
        const char *src, *name, *reason;
    } files[] = {
        {"{% for m in messages %}[{{ m.role }}] {{ m.content | trim }}\n{% endfor %}", "jinja", ""},
        {"{% include 'x.jinja' %}<|im_start|>", "chatml", "unsupported tag 'include'"},
        {"{{ messages[0].content.nosuch() }}<|start_header_id|>", "llama3", "line 1"},
    };
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/test_chat_template_%d_%zu.jinja", DUET_BINARY_DIR, (int)getpid(), i);
        FILE *f = fopen(path, "w");
        ck_assert_ptr_nonnull(f);
        fputs(files[i].src, f);
        fclose(f);
        ck_assert_msg(duet_chat_template_load(NULL, path, &t) == DUET_OK, "%s", duet_last_error());
        remove(path);
        ck_assert_str_eq(duet_chat_template_name(t), files[i].name);
        ck_assert_msg(strstr(duet_chat_template_fallback_reason(t), files[i].reason), "file %zu: reason [%s]",
                      i, duet_chat_template_fallback_reason(t));
        out = render(t, conv, true);
        ck_assert_msg(strstr(out, "Hi"), "file %zu: %s", i, out);
        free(out);
        duet_chat_template_free(t);
    }

    /* A template's raise_exception is the request's error. */
    ck_assert_int_eq(
        duet_chat_template_parse("{% if messages[-1].role != 'user' %}{{ raise_exception('the last "
                                 "message must be the user\\'s') }}{% endif %}{{ messages[0].content }}",
                                 "<s>", "</s>", &t),
        DUET_OK);
    ck_assert_str_eq(duet_chat_template_name(t), "jinja");
    const char *two = "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", "
                      "\"content\": \"b\"}]}";
    out = NULL;
    ck_assert_int_eq(duet_chat_template_apply(t, two, true, &out), DUET_BAD_REQUEST);
    ck_assert_ptr_null(out);
    ck_assert_msg(strstr(duet_last_error(), "the last message must be the user's"), "%s", duet_last_error());
    duet_chat_template_free(t);
}
END_TEST

static Suite *suite(void) {
    Suite *s = suite_create("chat_template");
    TCase *tc = tcase_create("families");
    tcase_add_test(tc, family_for_model_template);
    tcase_add_test(tc, family_rendering);
    tcase_add_test(tc, bad_conversations);
    suite_add_tcase(s, tc);
    tc = tcase_create("jinja");
    tcase_add_test(tc, model_jinja_template);
    suite_add_tcase(s, tc);
    return s;
}

int main(void) {
    return test_run_suite(suite());
}

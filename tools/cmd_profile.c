/* cmd_profile.c — `duet profile`: measures real steps of a grid of shapes
 * on one backend and device, fits the step-cost model (step time as a
 * function of decode tokens, prompt tokens and context) and writes it to a
 * file that `duet-bench --simulate` and `duet serve --step-cost` read. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "step_log.h"

static void usage(FILE *f) {
    fprintf(f, "usage: duet profile -m MODEL --out FILE [options]\n"
               "       duet profile --from-step-log STEPS.csv --out FILE [-c N]\n"
               "Times real engine steps (decode batches at several contexts, prompt chunks, and mixed\n"
               "steps) on one backend and device, fits\n"
               "  seconds = intercept + per_decode_token*n_decode + per_prefill_token*n_prefill\n"
               "          + per_decode_context*decode_ctx + per_prefill_context*prefill_ctx\n"
               "by non-negative least squares, writes it as JSON and prints the fit.\n"
               "  -m, --model FILE          the GGUF model\n"
               "  -o, --out FILE            where to write the step-cost model (JSON)\n"
               "      --backend NAME        auto|cpu|vulkan|opencl (default auto)\n"
               "      --device I            device within the backend (default: best)\n"
               "  -t, --threads N           cpu threads (default: all cores)\n"
               "  -c, --ctx N               context recorded for the simulator (default: what serve uses)\n"
               "      --kv-type T           f32|f16|q8_0 (default: as serve)\n"
               "      --decode-batches L    decode batch sizes (default 1,2,4,8,16)\n"
               "      --chunks L            prompt chunk sizes (default 16,32,64,128)\n"
               "      --contexts L          contexts, in tokens before the step (default 16,128,512)\n"
               "      --repeats N           timed rounds of the grid, medians kept (default 3)\n"
               "      --budget S            no new shapes or rounds after S seconds (default 45)\n"
               "      --quiet               no progress line\n"
               "      --from-step-log FILE  no grid: fit the served steps of a step log (duet serve\n"
               "                            --step-log; its cold first steps left out) instead, with\n"
               "                            their dispersion: the device as it served\n");
}

/* Parses "1,2,4" into out[] (at most max); false with a message. */
static bool parse_ints(const char *flag, const char *s, int *out, int max, int *n) {
    *n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 1 || v > 65536 || *n == max || (*end && *end != ',')) {
            fprintf(stderr, "duet: %s wants a list of up to %d positive integers (e.g. 1,2,4), got '%s'\n",
                    flag, max, s);
            return false;
        }
        out[(*n)++] = (int)v;
        p = *end ? end + 1 : end;
    }
    if (*n == 0) fprintf(stderr, "duet: %s is empty\n", flag);
    return *n > 0;
}

static void on_progress(int done, int total, void *user) {
    if (!*(bool *)user) return;
    fprintf(stderr, "\rprofiling: %d/%d shapes", done, total);
    if (done == total) fputc('\n', stderr);
}

/* Prints the fitted terms, the token-count correction and the quality. */
static void print_fit(const duet_step_cost *fit) {
    printf("fit: ");
    for (int j = 0; j < DUET_STEP_COST_TERMS; j++)
        printf("%s%s %.4g %s", j ? ", " : "", duet_step_cost_term(j), fit->coef[j] * (j < 3 ? 1e3 : 1e6),
               j < 3 ? "ms" : "us");
    for (int k = 0; k < fit->n_knots; k++)
        printf("%s%d: %+.3g ms",
               k ? ", " : "\ntoken-count correction (step tokens: ms): ", fit->knot_tokens[k],
               fit->knot_s[k] * 1e3);
    printf("\nquality: R^2 %.4f, rmse %.3f ms, mean relative error %.1f%%\n", fit->r2, fit->rmse_s * 1e3,
           fit->mean_rel_err * 100);
}

/* --from-step-log: the model of the steps a server ran, every one a
 * sample (served shapes rarely repeat, so no medians), and their
 * dispersion around it. */
static int fit_step_log(const char *path, const char *out, int n_ctx) {
    duet_step_sample *smp;
    int n, n_cold;
    char err[1024];
    if (!step_log_read(path, &smp, &n, &n_cold, err, sizeof err)) {
        fprintf(stderr, "duet: profile: %s\n", err);
        return 1;
    }
    if (n == 0) {
        fprintf(stderr, "duet: profile: %s has no served step to fit (%d cold ones left out)\n", path,
                n_cold);
        free(smp);
        return 1;
    }
    duet_step_cost fit;
    duet_status st = duet_step_cost_fit(smp, n, &fit);
    if (!st) {
        duet_step_cost_fit_noise(&fit, smp, n);
        fit.n_ctx = n_ctx;
        st = duet_step_cost_save(&fit, NULL, 0, out);
    }
    free(smp);
    if (st) return cli_fail("profile", st);
    printf("%d served steps of %s (%d cold ones left out)\n", n, path, n_cold);
    /* Each knot of the token-count correction is the median residual of
     * the steps nearest it: with few of them it follows those steps, and
     * the dispersion measured on the same steps comes out too narrow. */
    if (fit.n_knots > 0 && n < 8 * fit.n_knots)
        fprintf(stderr,
                "duet: profile: warning: %d steps for %d token-count knots (fewer than 8 a knot): the "
                "correction follows these steps and the dispersion comes out narrow; fit a longer log\n",
                n, fit.n_knots);
    print_fit(&fit);
    printf("dispersion (measured / predicted):");
    for (int k = 0; k < fit.n_noise; k++)
        printf(" p%g %.3f", 100 * fit.noise_level[k], fit.noise_ratio[k]);
    printf("\nwritten: %s\n", out);
    return 0;
}

int cmd_profile(int argc, char **argv) {
    enum { O_BACKEND = 256, O_DEVICE, O_KV, O_DEC, O_CHUNK, O_CTXS, O_REP, O_BUDGET, O_QUIET, O_FROM_LOG };
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"out", required_argument, 0, 'o'},
                                         {"backend", required_argument, 0, O_BACKEND},
                                         {"device", required_argument, 0, O_DEVICE},
                                         {"threads", required_argument, 0, 't'},
                                         {"ctx", required_argument, 0, 'c'},
                                         {"kv-type", required_argument, 0, O_KV},
                                         {"decode-batches", required_argument, 0, O_DEC},
                                         {"chunks", required_argument, 0, O_CHUNK},
                                         {"contexts", required_argument, 0, O_CTXS},
                                         {"repeats", required_argument, 0, O_REP},
                                         {"budget", required_argument, 0, O_BUDGET},
                                         {"quiet", no_argument, 0, O_QUIET},
                                         {"from-step-log", required_argument, 0, O_FROM_LOG},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL, *out = NULL, *from_log = NULL;
    int grid_opt = 0; /* the last option of the timed grid given: none applies to a log */
    duet_profile_params p = duet_profile_params_default();
    int dec[64], chk[64], ctx[64], n_ctx = 0;
    bool progress = isatty(2);
    optind = 1;
    int c;
    while ((c = getopt_long(argc, argv, "m:o:t:c:h", opts, NULL)) != -1) {
        bool ok = true;
        float budget;
        switch (c) {
        case 'm':
            model = optarg;
            break;
        case 'o':
            out = optarg;
            break;
        case O_BACKEND:
            p.open.backend = optarg;
            break;
        case O_DEVICE:
            ok = cli_int("--device", optarg, 0, 1024, &p.open.device);
            break;
        case 't':
            ok = cli_int("--threads", optarg, 0, 1024, &p.open.n_threads);
            break;
        case 'c':
            ok = cli_int("--ctx", optarg, 2, 1 << 20, &n_ctx);
            break;
        case O_KV:
            p.open.kv_type = optarg;
            break;
        case O_DEC:
            ok = parse_ints("--decode-batches", optarg, dec, 64, &p.n_decode_batch);
            p.decode_batch = dec;
            break;
        case O_CHUNK:
            ok = parse_ints("--chunks", optarg, chk, 64, &p.n_chunk);
            p.chunk = chk;
            break;
        case O_CTXS:
            ok = parse_ints("--contexts", optarg, ctx, 64, &p.n_context);
            p.context = ctx;
            break;
        case O_REP:
            ok = cli_int("--repeats", optarg, 1, 1000, &p.repeats);
            break;
        case O_BUDGET:
            ok = cli_float("--budget", optarg, 0.1, 86400, &budget);
            p.budget_s = budget;
            break;
        case O_QUIET:
            progress = false;
            break;
        case O_FROM_LOG:
            from_log = optarg;
            break;
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
        if (!ok) return 2;
        if (c == O_BACKEND || c == O_DEVICE || c == 't' || c == O_KV || c == O_DEC || c == O_CHUNK ||
            c == O_CTXS || c == O_REP || c == O_BUDGET)
            grid_opt = c;
    }
    if (optind < argc) {
        fprintf(stderr, "duet: unexpected argument '%s'\n", argv[optind]);
        usage(stderr);
        return 2;
    }
    if (from_log) {
        if (model || !out) {
            fprintf(stderr, "duet: profile --from-step-log needs --out FILE and no -m: it fits the log\n");
            return 2;
        }
        if (grid_opt) {
            const char *name = "?";
            for (const struct option *o = opts; o->name; o++)
                if (o->val == grid_opt) name = o->name;
            fprintf(stderr, "duet: profile --from-step-log fits a log: --%s does not apply\n", name);
            return 2;
        }
        return fit_step_log(from_log, out, n_ctx);
    }
    if (!model || !out) {
        fprintf(stderr, "duet: profile needs -m MODEL and --out FILE\n");
        usage(stderr);
        return 2;
    }
    p.open.n_ctx = n_ctx; /* only recorded: the profile sizes its own context */
    p.progress = on_progress;
    p.user = &progress;
    duet_step_sample *smp = NULL;
    int n = 0;
    duet_step_cost fit;
    duet_status st = duet_profile_run(model, &p, &smp, &n, &fit);
    if (st) return cli_fail("profile", st);
    if (n_ctx) fit.n_ctx = n_ctx;
    st = duet_step_cost_save(&fit, smp, n, out);
    if (st) {
        free(smp);
        return cli_fail("profile", st);
    }
    printf("%s on %s (%s): %d step shapes\n", fit.model, fit.backend, fit.device, n);
    printf("%-8s %-8s %-10s %-11s %10s %10s %7s\n", "decode", "prefill", "decode_ctx", "prefill_ctx",
           "measured", "predicted", "error");
    for (int i = 0; i < n; i++) {
        double pred = duet_step_cost_predict(&fit, &smp[i].shape);
        printf("%-8d %-8d %-10.0f %-11.0f %8.2fms %8.2fms %+6.1f%%\n", smp[i].shape.n_decode,
               smp[i].shape.n_prefill, smp[i].shape.decode_ctx, smp[i].shape.prefill_ctx,
               smp[i].seconds * 1e3, pred * 1e3,
               smp[i].seconds > 0 ? 100 * (pred - smp[i].seconds) / smp[i].seconds : 0.0);
    }
    print_fit(&fit);
    printf("written: %s\n", out);
    free(smp);
    return 0;
}

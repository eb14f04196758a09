/* test_jinja.c — the Jinja interpreter (core/jinja.c): the language pieces
 * against outputs of the PyPI jinja2 package (3.1.6, in the environment
 * transformers uses: sandboxed, trim_blocks, lstrip_blocks, its tojson),
 * whitespace control, error messages with line numbers, and the limits that
 * keep a hostile template from hanging or exhausting the server. The real
 * templates are compared with jinja2 live by tests/test_chat_templates.py.
 */
#include <cjson/cJSON.h>

#include "jinja.h"
#include "test_util.h"

/* The variables every case renders with. */
static const char *const vars_json =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Sys <x> & 'y'\"}, {\"role\": \"user\", "
    "\"content\": \"  "
    "Hi there  \"}], \"d\": {\"b\": 2, \"a\": 1, \"c\": [1, 2.5, null, true, \"x\"]}, \"n\": 7, \"f\": 2.5, "
    "\"s\": "
    "\"Hello, World\", \"e\": [], \"u8\": \"héllo wörld 日本\", \"items\": [{\"name\": \"b\", \"v\": 2, "
    "\"t\": "
    "\"x\"}, {\"name\": \"a\", \"v\": 1, \"t\": \"y\"}, {\"name\": \"c\", \"v\": 3, \"t\": \"x\"}]}";

/* 2026-01-15 10:30:00 UTC, for strftime_now */
#define NOW 1768473000

static duet__jinja_result render(const char *src, const char *json, const duet__jinja_options *opt,
                                 char **out, char *err, size_t errlen) {
    duet__jinja_template *t = NULL;
    duet__jinja_result r = duet__jinja_parse(src, strlen(src), &t, err, errlen);
    if (r != DUET__JINJA_OK) return r;
    cJSON *vars = json ? cJSON_Parse(json) : NULL;
    duet__jinja_options o = opt ? *opt : (duet__jinja_options){0};
    o.now = NOW;
    r = duet__jinja_render(t, vars, &o, out, NULL, err, errlen);
    cJSON_Delete(vars);
    duet__jinja_free(t);
    return r;
}

/* Outputs of jinja2 3.1.6 for the template with vars_json. */
static const struct {
    const char *src, *want;
} cases[] = {
    {"{{ 1 + 2 * 3 }}|{{ 7 // 2 }}|{{ -7 // 2 }}|{{ 7 % -3 }}|{{ 2 ** 10 }}|{{ 7 / 2 }}|{{ 4 / 2 }}|{{ 1.5 + "
     "1 }}",
     "7|3|-4|-2|1024|3.5|2.0|2.5"},
    {"{{ 0.1 + 0.2 }}|{{ 1e20 }}|{{ 1.0 }}|{{ 1e-5 }}|{{ 123456789012345678.0 }}|{{ f * 2 }}|{{ 3.14159 }}",
     "0.30000000000000004|1e+20|1.0|1e-05|1.2345678901234568e+17|5.0|3.14159"},
    {"{{ \"a\" ~ 1 ~ none ~ true }}|{{ 'x' * 3 }}|{{ [1,2] + [3] }}|{{ \"ab\" + \"cd\" }}",
     "a1NoneTrue|xxx|[1, 2, 3]|abcd"},
    {"{{ s[0] }}{{ s[-1] }}|{{ s[::-1] }}|{{ s[1:4] }}|{{ s[:-3] }}|{{ u8[1:3] }}|{{ u8[::-1] }}|{{ "
     "[1,2,3,4][::2] }}|{{ u8|length }}",
     "Hd|dlroW ,olleH|ell|Hello, Wo|él|本日 dlröw olléh|[1, 3]|14"},
    {"{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}{% if not loop.last %}, {% endif "
     "%}{% endfor %}",
     "1/2:system, 2/2:user"},
    {"{% for x in [1,2,3,4,5] if x is odd %}{{ loop.index0 }}={{ x }}{{ loop.previtem }}{{ loop.nextitem }} "
     "{% else %}none{% endfor %}",
     "0=13 1=315 2=53 "},
    {"{% for x in e %}x{% else %}empty{% endfor %}", "empty"},
    {"{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}", "b=2;a=1;c=[1, 2.5, None, True, 'x'];"},
    {"{% for k in d %}{{ k }}{% endfor %}|{{ d|dictsort }}|{{ d|dictsort(by='value', reverse=true) if false "
     "else '' }}",
     "bac|[('a', 1), ('b', 2), ('c', [1, 2.5, None, True, 'x'])]|"},
    {"{% set ns = namespace(count=0, last=none) %}{% for m in messages %}{% set ns.count = ns.count + 1 %}{% "
     "set ns.last = m.role %}{% endfor %}{{ ns.count }} {{ ns.last }}",
     "2 user"},
    {"{% set x = 1 %}{% for i in [1,2] %}{% set x = i %}{% endfor %}{{ x }}", "1"},
    {"{% set x = 1 %}{% if true %}{% set x = 2 %}{% endif %}{{ x }}", "2"},
    {"{% macro greet(name, greeting='Hello') %}{{ greeting }}, {{ name }}!{% endmacro %}{{ greet('Bob') }} "
     "{{ greet('Ann', greeting='Hi') }} {{ greet('Z', 'Yo') }}",
     "Hello, Bob! Hi, Ann! Yo, Z!"},
    {"{% set b %}  inner {{ n }} {% endset %}[{{ b }}]", "[  inner 7 ]"},
    {"{% raw %}{{ not rendered }}{% endraw %}", "{{ not rendered }}"},
    {"  {% if true %}\n    yes\n  {% endif %}\n  {{ n }}\n  {#- comment #}\nafter", "    yes\n  7after"},
    {"{%- for i in range(3) -%}\n   {{ i }}\n{%- endfor %}\nend", "012end"},
    {"a   {%- if true %} b {% endif -%}   c\n  {%+ if true %}d{% endif %}", "a b c\n  d"},
    {"{{ messages[0].content|trim }}|{{ messages[1].content|trim }}|{{ '  x '|trim }}|{{ 'xxhixx'|trim('x') "
     "}}",
     "Sys <x> & 'y'|Hi there|x|hi"},
    {"{{ d|tojson }}|{{ d|tojson(indent=2) }}|{{ messages|tojson }}|{{ \"é<>&'\"|tojson }}|{{ "
     "d|tojson(sort_keys=true) }}|{{ [1.5, 1e20, 10.0]|tojson }}",
     "{\"b\": 2, \"a\": 1, \"c\": [1, 2.5, null, true, \"x\"]}|{\n  \"b\": 2,\n  \"a\": 1,\n  \"c\": [\n    "
     "1,\n    2.5,\n    null,\n    true,\n    \"x\"\n  ]\n}|[{\"role\": \"system\", \"content\": \"Sys <x> & "
     "'y'\"}, {\"role\": \"user\", \"content\": \"  Hi there  \"}]|\"é<>&'\"|{\"a\": 1, \"b\": 2, \"c\": [1, "
     "2.5, null, true, \"x\"]}|[1.5, 1e+20, 10.0]"},
    {"{{ d|tojson(separators=(',', ':')) }}|{{ {}|tojson(indent=2) }}|{{ []|tojson(indent=2) }}|{{ {'a': "
     "[]}|tojson(indent=2) }}",
     "{\"b\":2,\"a\":1,\"c\":[1,2.5,null,true,\"x\"]}|{}|[]|{\n  \"a\": []\n}"},
    {"{{ items|map(attribute='name')|join(', ') }}|{{ items|selectattr('t', 'equalto', "
     "'x')|map(attribute='v')|list }}|{{ items|rejectattr('t', 'equalto', 'x')|list|length }}",
     "b, a, c|[2, 3]|1"},
    {"{{ items|sort(attribute='name')|map(attribute='name')|join }}|{{ [3,1,2]|sort }}|{{ "
     "[3,1,2]|sort(reverse=true) }}|{{ ['b','A','c']|sort }}|{{ ['b','A','c']|sort(case_sensitive=true) }}",
     "abc|[1, 2, 3]|[3, 2, 1]|['A', 'b', 'c']|['A', 'b', 'c']"},
    {"{{ [1,2,2,3,1]|unique|list }}|{{ ['a','A','b']|unique|list }}|{{ [1,2,3]|first }}{{ [1,2,3]|last }}|{{ "
     "'abc'|first }}|{{ e|first is defined }}",
     "[1, 2, 3]|['a', 'b']|13|a|False"},
    {"{{ x|default('dflt') }}|{{ ''|default('dflt') }}|{{ ''|default('dflt', true) }}|{{ none|default('z') "
     "}}|{{ x is defined }}|{{ n is defined }}",
     "dflt||dflt|None|False|True"},
    {"{{ n is number }}{{ n is integer }}{{ f is float }}{{ s is string }}{{ d is mapping }}{{ e is iterable "
     "}}{{ e is sequence }}{{ none is none }}{{ n is odd }}{{ n is even }}{{ n is divisibleby 7 }}{{ true is "
     "boolean }}",
     "TrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueTrue"},
    {"{{ 'a' in 'cat' }}{{ 'z' not in 'cat' }}{{ 1 in [1,2] }}{{ 'a' in d }}{{ 3 in d }}{{ 1 < 2 < 3 }}{{ 1 "
     "< 2 > 3 }}{{ 'a' < 'b' }}{{ [1,2] == [1,2] }}{{ 1 == 1.0 }}{{ true == 1 }}",
     "TrueTrueTrueTrueFalseTrueFalseTrueTrueTrueTrue"},
    {"{{ s.upper() }}|{{ s.lower() }}|{{ 'hello world'.title() }}|{{ s.split(', ') }}|{{ '  a  b '.split() "
     "}}|{{ 'a,b,c'.split(',', 1) }}|{{ s.startswith('Hell') }}|{{ s.endswith(('x', 'ld')) }}",
     "HELLO, WORLD|hello, world|Hello World|['Hello', 'World']|['a', 'b']|['a', 'b,c']|True|True"},
    {"{{ s.replace('l', 'L') }}|{{ s.replace('l', 'L', 2) }}|{{ '  x  '.lstrip() }}|{{ '  x  '.rstrip() "
     "}}|{{ s.find('o') }}|{{ s.count('l') }}|{{ '{} and {}'.format(1, 'b') }}|{{ '{name}!'.format(name='N') "
     "}}",
     "HeLLo, WorLd|HeLLo, World|x  |  x|4|3|1 and b|N!"},
    {"{{ d.get('a') }}|{{ d.get('zz') }}|{{ d.get('zz', 5) }}|{{ d.keys()|list }}|{{ d.values()|list|length "
     "}}|{{ d['a'] }}|{{ d.a }}|{{ d.zz is defined }}",
     "1|None|5|['b', 'a', 'c']|3|1|1|False"},
    {"{{ 'hello'|upper }}|{{ 'HeLLo'|lower }}|{{ 'hello world'|capitalize }}|{{ 'hello world'|title }}|{{ "
     "'a-b'|replace('-', '+') }}|{{ 42|string }}{{ '12'|int + 1 }}{{ 'x'|int }}{{ '3.7'|int }}{{ 3.7|int "
     "}}{{ '2.5'|float }}",
     "HELLO|hello|Hello world|Hello World|a+b|42130332.5"},
    {"{{ \"line1\\nline2\\n\\nline4\"|indent(2) }}|{{ \"a\\nb\"|indent(2, true) }}|{{ \"a\\n\\nb\"|indent(4, "
     "blank=true) }}",
     "line1\n  line2\n\n  line4|  a\n  b|a\n    \n    b"},
    {"{{ [1,2,3]|join('-') }}|{{ items|join(',', attribute='name') }}|{{ 'abc'|list }}|{{ d|list }}|{{ (1,2) "
     "}}|{{ (1,) }}|{{ d.items()|list }}",
     "1-2-3|b,a,c|['a', 'b', 'c']|['b', 'a', 'c']|(1, 2)|(1,)|[('b', 2), ('a', 1), ('c', [1, 2.5, None, "
     "True, 'x'])]"},
    {"{{ none }}|{{ true }}|{{ false }}|{{ d }}|{{ [none, true, 'it\\'s', \"q\\\"\", 1.5] }}|{{ x }}|",
     "None|True|False|{'b': 2, 'a': 1, 'c': [1, 2.5, None, True, 'x']}|[None, True, \"it's\", 'q\"', 1.5]||"},
    {"{{ strftime_now('%Y-%m-%d %H:%M %B %d %b') }}", "2026-01-15 10:30 January 15 Jan"},
    {"{{ range(5)|list }}|{{ range(2, 10, 3)|list }}|{{ range(5, 0, -2)|list }}|{{ range(0)|list }}",
     "[0, 1, 2, 3, 4]|[2, 5, 8]|[5, 3, 1]|[]"},
    {"{% if false %}{{ d|nofilter }}{% endif %}ok", "ok"},
    {"{% for i in range(10) %}{% if i == 3 %}{% continue %}{% endif %}{% if i == 6 %}{% break %}{% endif "
     "%}{{ i }}{% endfor %}",
     "01245"},
    {"{{ 'yes' if n > 5 else 'no' }}|{{ 'yes' if n > 50 }}|{{ 'a' if false else 'b' if true else 'c' }}",
     "yes||b"},
    {"{{ not true }}|{{ not none is none }}|{{ true and 'x' }}|{{ false or 'y' }}|{{ none or 0 }}|{{ 0 and 1 "
     "}}",
     "False|False|x|y|0|0"},
    {"{{ -n }}|{{ -f }}|{{ +n }}|{{ -(n) ** 2 }}|{{ 2 ** 3 ** 2 }}", "-7|-2.5|7|49|64"},
    {"{% set a, b = [1, 2] %}{{ a }}{{ b }}", "12"},
    {"{{ items|selectattr('v', 'gt', 1)|list|length }}|{{ [1,2,3,4]|select('even')|list }}|{{ "
     "[0,1,'',None,'a']|select|list }}|{{ [1,2,3]|reject('odd')|list }}",
     "2|[2, 4]|[1, 'a']|[2]"},
    {"{{ [3,1,2]|max }}{{ [3,1,2]|min }}{{ [1,2,3]|sum }}{{ items|sum(attribute='v') }}|{{ -3|abs }}|{{ "
     "[1,2]|reverse|list }}|{{ 'abc'|reverse }}",
     "3166|3|[2, 1]|cba"},
    {"{{ items|map(attribute='v')|list|tojson }}|{{ items|map('upper') if false else '' }}|{{ "
     "['a','b']|map('upper')|list }}",
     "[2, 1, 3]||['A', 'B']"},
    {"{{ \"<a href='x'>&</a>\"|e }}|{{ '<b>'|safe }}|{{ '<'|safe + '<' }}|{{ '<' + '<'|safe }}|{{ ('<'|safe "
     "+ '<')|length }}",
     "&lt;a href=&#39;x&#39;&gt;&amp;&lt;/a&gt;|<b>|<&lt;|&lt;<|5"},
    {"{% filter upper %}abc {{ n }}{% endfilter %}", "ABC 7"},
    {"{% macro m() %}[{{ caller is defined }}]{% endmacro %}{{ m() }}", "[False]"},
    {"{{ messages|length }}{{ e|length }}{{ 'abc'|count }}{{ messages[5] is defined }}{{ messages[-1].role "
     "}}{{ s.0 if false else '' }}",
     "203Falseuser"},
    {"{{ d|items|list }}|{{ {'x': 1, 2: 'y'} }}|{{ {'a': {'b': [1, {'c': none}]}}|tojson }}",
     "[('b', 2), ('a', 1), ('c', [1, 2.5, None, True, 'x'])]|{'x': 1, 2: 'y'}|{\"a\": {\"b\": [1, {\"c\": "
     "null}]}}"},
    {"{%- set tools = none -%}{{ tools is none }}{{ tools|selectattr('x')|list }}", "True[]"},
    {"{{ '%s'|format(1) if false else 'fmt' }}|{{ loop is defined }}|{{ \"a\\tb\\\\c\" }}|{{ '\\u00e9\\x41' "
     "}}",
     "fmt|False|a\tb\\c|éA"},
    {"{# comment #}\n{% if true %}\nx\n{% endif %}\n   {# indented comment #}\ny", "x\ny"},
    {"{{ messages[0]['content'] }}{{ messages[0].content.split(' ')[0] }}{{ messages | map(attribute='role') "
     "| join(',') }}",
     "Sys <x> & 'y'Syssystem,user"},
    {"{% for m in messages %}{% if loop.first %}F{% endif %}{{ loop.revindex }}{{ loop.cycle('a','b') }}{% "
     "endfor %}",
     "F2a1b"},
    {"{{ d.c[1:] }}|{{ d.c[-2:] }}|{{ d.c|length }}|{{ d.c[0] + d.c[1] }}|{{ d.c[4]|upper }}",
     "[2.5, None, True, 'x']|[True, 'x']|5|3.5|X"},
    {"{{ 'abc' is lower }}{{ 'ABC' is upper }}{{ 'Hello'.isalpha() }}{{ '123'.isdigit() }}{{ 10 is gt 5 }}{{ "
     "3 is le 3 }}{{ [1] is sameas [1] }}{{ none is sameas none }}",
     "TrueTrueTrueTrueTrueTrueFalseTrue"},
    {"{% macro r(n) %}{% if n > 0 %}{{ n }}{{ r(n - 1) }}{% endif %}{% endmacro %}{{ r(5) }}", "54321"},
    {"{{ u8|upper }}|{{ u8.upper() }}|{{ 'ÉCOLE Ÿ Ω Ж'|lower }}|{{ 'élan vital-x (a)b'|title }}|{{ 'élan "
     "vital-x (a)b'.title() }}|{{ \"it's o'neil\"|title }}|{{ \"it's o'neil\".title() }}|{{ 'ÿ ł ő'.upper() "
     "}}|{{ 'aBc'.swapcase() }}",
     "HÉLLO WÖRLD 日本|HÉLLO WÖRLD 日本|école ÿ ω ж|Élan Vital-X (A)b|Élan Vital-X (A)B|It's O'neil|It'S "
     "O'Neil|Ÿ Ł Ő|AbC"},
    {"{{ ' \\u00a0x\\u3000 '|trim }}|{{ 'a\\u2003b  c'.split() }}|{{ '\\u00a0'|length }}|{{ "
     "'x\\u00a0'.rstrip() }}|",
     "x|['a', 'b', 'c']|1|x|"},
    {"{{ range(3) }}|{{ range(1, 10, 2) }}|{{ range(10)[2:5] }}|{{ range(3)|list }}|{{ range(3) == [0, 1, 2] "
     "}}|{{ range(3)|length }}|{{ (1, 2, 3)[1:] }}",
     "range(0, 3)|range(1, 10, 2)|range(2, 5)|[0, 1, 2]|False|3|(2, 3)"},
    {"{{ 1|round }}|{{ 2.5|round }}|{{ 3.5|round }}|{{ 2.675|round(2) }}|{{ 1.234|round(1, 'floor') }}|{{ "
     "1.21|round(1, 'ceil') }}|{{ 7|round(0, 'floor') }}|{{ -2.5|round }}|{{ 1234.5|round(-2) }}",
     "1|2.0|4.0|2.67|1.2|1.3|7.0|-2.0|1200.0"},
};

START_TEST(test_render_like_jinja2) {
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *out = NULL, err[512];
        duet__jinja_result r = render(cases[i].src, vars_json, NULL, &out, err, sizeof err);
        ck_assert_msg(r == DUET__JINJA_OK, "case %zu (%s): %s", i, cases[i].src, err);
        ck_assert_msg(!strcmp(out, cases[i].want), "case %zu (%s):\n got  [%s]\n want [%s]", i, cases[i].src,
                      out, cases[i].want);
        free(out);
    }
}
END_TEST

/* Errors: the kind, and a message that names the problem and the line. */
static const struct {
    const char *src;
    duet__jinja_result code;
    const char *msg;
} errors[] = {
    {"{{ raise_exception('boom') }}", DUET__JINJA_RAISED, "boom"},
    {"a\n{{ x.y }}", DUET__JINJA_RENDER, "line 2: 'x' is undefined"},
    {"{{ n + 'a' }}", DUET__JINJA_RENDER, "unsupported operand type(s) for +: 'int' and 'str'"},
    {"{% for x in 5 %}{% endfor %}", DUET__JINJA_RENDER, "'int' object is not iterable"},
    {"\n\n{% if %}{% endif %}", DUET__JINJA_SYNTAX, "line 3: expected an expression"},
    {"{% for x in [1] %}", DUET__JINJA_SYNTAX, "the 'for' tag of line 1 is not closed"},
    {"{{ d|nofilter }}", DUET__JINJA_SYNTAX, "no filter named 'nofilter'"},
    {"{% if false %}{{ d|nofilter }}{% endif %}{{ d|nofilter }}", DUET__JINJA_SYNTAX, "no filter named"},
    {"{% if true %}{{ d|nofilter }}{% endif %}", DUET__JINJA_RENDER, "No filter named 'nofilter'"},
    {"{% include 'x' %}", DUET__JINJA_SYNTAX, "unsupported tag 'include'"},
    {"{% set l = [1] %}{{ l.append(2) }}", DUET__JINJA_RENDER, "unsafe"},
    {"{{ 5 // 0 }}", DUET__JINJA_RENDER, "division or modulo by zero"},
    {"{% macro r(n) %}{{ r(n + 1) }}{% endmacro %}{{ r(0) }}", DUET__JINJA_LIMIT, "nested more than"},
    {"{{ 'abc", DUET__JINJA_SYNTAX, "unterminated string"},
    {"{# never closed", DUET__JINJA_SYNTAX, "missing end of comment"},
    {"{% raw %}x", DUET__JINJA_SYNTAX, "missing end of raw"},
    {"{{ (1 }}", DUET__JINJA_SYNTAX, "line 1"},
    {"{{ 1 ) }}", DUET__JINJA_SYNTAX, "unexpected ')'"},
    {"{% endif %}", DUET__JINJA_SYNTAX, "unexpected 'endif'"},
    {"{% if true %}{% endfor %}", DUET__JINJA_SYNTAX, "unexpected 'endfor'"},
    {"{{ range(1000000)|length }}", DUET__JINJA_RENDER, "Range too big"},
    {"{{ 9223372036854775807 + 1 }}", DUET__JINJA_RENDER, "overflow"},
    {"{{ d|tojson(indent='x') }}", DUET__JINJA_RENDER, "indent"},
    {"{{ d.items()|tojson }}", DUET__JINJA_RENDER, "not JSON serializable"},
    {"{{ x|tojson }}", DUET__JINJA_RENDER, "not JSON serializable"},
    {"{{ items|map(attribute='v')|length }}", DUET__JINJA_RENDER, "has no len()"},
    {"{% set a, b = [1, 2, 3] %}", DUET__JINJA_RENDER, "too many values to unpack"},
    {"{% set s.x = 1 %}", DUET__JINJA_RENDER, "non-namespace"},
    {"{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}", DUET__JINJA_RENDER, "takes not more than 1 argument"},
    {"{{ 1 < 'a' }}", DUET__JINJA_RENDER, "not supported between instances of 'int' and 'str'"},
    {"{{ s.nomethod() }}", DUET__JINJA_RENDER, "line 1"},
    {"{% for x in [1] recursive %}{% endfor %}", DUET__JINJA_SYNTAX, "recursive loops are not supported"},
    {"{{ 'straße'|upper }}", DUET__JINJA_RENDER, "changing the case of U+00DF is not supported"},
    {"{{ 'ΣΑ'|lower }}", DUET__JINJA_RENDER, "U+03A3"},
    {"{{ 1 is none 2 }}", DUET__JINJA_RENDER, "test_none() takes 1 positional argument but 2 were given"},
    {"{{ true[::-1] }}", DUET__JINJA_RENDER, "'bool' object is not subscriptable"},
    {"{{ 3|indent }}", DUET__JINJA_RENDER, "indent needs a string"},
    {"{{ x|int }}", DUET__JINJA_RENDER, "undefined"},
    {"{{ [1] < (1,) }}", DUET__JINJA_RENDER, "not supported between instances"},
    {"{{ [1]|map('string') }}", DUET__JINJA_RENDER, "printing a generator is not supported"},
    {"{{ '%s' % 1 }}", DUET__JINJA_RENDER, "printf-style"},
    {"{{ d[] }}", DUET__JINJA_SYNTAX, "expected an expression"}, /* found by fuzz_jinja */
};

START_TEST(test_errors) {
    for (size_t i = 0; i < sizeof errors / sizeof *errors; i++) {
        char *out = NULL, err[512];
        duet__jinja_result r = render(errors[i].src, vars_json, NULL, &out, err, sizeof err);
        ck_assert_msg(r == errors[i].code, "case %zu (%s): result %d, want %d (%s)", i, errors[i].src, r,
                      errors[i].code, r ? err : out);
        ck_assert_ptr_null(out);
        ck_assert_msg(strstr(err, errors[i].msg), "case %zu (%s): message [%s] lacks [%s]", i, errors[i].src,
                      err, errors[i].msg);
    }
}
END_TEST

/* A hostile template ends with a limit error, quickly, whatever it tries. */
START_TEST(test_limits) {
    char *out = NULL, err[512];
    /* output */
    duet__jinja_options o = {.max_output = 1 << 16};
    ck_assert_int_eq(render("{% for i in range(100000) %}{{ 'xxxxxxxxxx' * 100 }}{% endfor %}", NULL, &o,
                            &out, err, sizeof err),
                     DUET__JINJA_LIMIT);
    ck_assert_ptr_nonnull(strstr(err, "output is longer than"));
    /* loop iterations */
    o = (duet__jinja_options){.max_steps = 100000};
    ck_assert_int_eq(
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", NULL, &o,
               &out, err, sizeof err),
        DUET__JINJA_LIMIT);
    ck_assert_ptr_nonnull(strstr(err, "loop iterations"));
    /* memory: a string doubled until it no longer fits */
    o = (duet__jinja_options){.max_memory = 8 << 20, .max_output = 1 << 30};
    ck_assert_int_eq(
        render("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
               "{% endfor %}",
               NULL, &o, &out, err, sizeof err),
        DUET__JINJA_LIMIT);
    /* deep nesting is a syntax error, not a stack overflow */
    size_t depth = 100000;
    char *deep = malloc(2 * depth + 16);
    memcpy(deep, "{{ ", 3);
    memset(deep + 3, '(', depth);
    deep[3 + depth] = '1';
    memset(deep + 4 + depth, ')', depth);
    strcpy(deep + 4 + 2 * depth, " }}");
    ck_assert_int_eq(render(deep, NULL, NULL, &out, err, sizeof err), DUET__JINJA_SYNTAX);
    ck_assert_ptr_nonnull(strstr(err, "nested too deeply"));
    free(deep);
    ck_assert_ptr_null(out);
}
END_TEST

/* jinja2's whitespace rules, each on its own. */
START_TEST(test_whitespace) {
    static const struct {
        const char *src, *want;
    } ws[] = {
        {"a\n{% if true %}\nb\n{% endif %}\nc\n", "a\nb\nc"}, /* trim_blocks; the last newline goes */
        {"a\n    {% if true %}\n    b\n    {% endif %}\n", "a\n    b\n"}, /* lstrip_blocks */
        {"a  {{- 'x' -}}  b", "axb"},
        {"a  {%- if true -%}  b  {%- endif -%}  c", "abc"},
        {"  {{ 'x' }}\n", "  x"},                            /* no lstrip or trim for {{ }} */
        {"x {# c #}\ny", "x y"},                             /* a comment is trimmed */
        {"  {%+ if true %}x{% endif %}", "  x"},             /* {%+ keeps the indentation */
        {"a {% if true %}b{% endif %}", "a b"},              /* not at a line start: kept */
        {"{% raw %}\n  {{ x }}{% endraw %}", "\n  {{ x }}"}, /* no trim after raw */
        {"a\r\nb\rc", "a\nb\nc"},                            /* newlines normalised */
    };
    for (size_t i = 0; i < sizeof ws / sizeof *ws; i++) {
        char *out = NULL, err[512];
        ck_assert_msg(render(ws[i].src, NULL, NULL, &out, err, sizeof err) == DUET__JINJA_OK, "case %zu: %s",
                      i, err);
        ck_assert_msg(!strcmp(out, ws[i].want), "case %zu: got [%s] want [%s]", i, out, ws[i].want);
        free(out);
    }
}
END_TEST

/* jinja2's own tojson (the option), against jinja2 3.1.6's outputs. */
START_TEST(test_jinja2_tojson) {
    static const char *const vars = "{\"d\": {\"b\": 2, \"a\": 1, \"c\": [1, 2.5, null, true, \"x\"]}, "
                                    "\"s\": \"<a href='x'>&é日</a>\"}";
    static const struct {
        const char *src, *want;
    } cases[] = {
        {"{{ d|tojson }}", "{\"a\": 1, \"b\": 2, \"c\": [1, 2.5, null, true, \"x\"]}"},
        {"{{ d|tojson(indent=2) }}", "{\n  \"a\": 1,\n  \"b\": 2,\n  \"c\": [\n    1,\n    2.5,\n    null,\n "
                                     "   true,\n    \"x\"\n  ]\n}"},
        {"{{ s|tojson }}", "\"\\u003ca href=\\u0027x\\u0027\\u003e\\u0026\\u00e9\\u65e5\\u003c/a\\u003e\""},
        {"{{ (s|tojson) + \"<\" }}",
         "\"\\u003ca href=\\u0027x\\u0027\\u003e\\u0026\\u00e9\\u65e5\\u003c/a\\u003e\"&lt;"},
    };
    duet__jinja_options o = {.jinja2_tojson = true};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *out = NULL, err[256];
        ck_assert_msg(render(cases[i].src, vars, &o, &out, err, sizeof err) == DUET__JINJA_OK, "%s", err);
        ck_assert_msg(!strcmp(out, cases[i].want), "case %zu: got [%s] want [%s]", i, out, cases[i].want);
        free(out);
    }
    char *out = NULL, err[256];
    ck_assert_int_eq(render("{{ d|tojson(sort_keys=false) }}", vars, &o, &out, err, sizeof err),
                     DUET__JINJA_RENDER);
}
END_TEST

/* One parsed template renders many times, with different variables. */
START_TEST(test_reuse) {
    const char *src = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}";
    duet__jinja_template *t = NULL;
    char err[256];
    ck_assert_int_eq(duet__jinja_parse(src, strlen(src), &t, err, sizeof err), DUET__JINJA_OK);
    for (int i = 0; i < 3; i++) {
        char json[128], want[64], *out = NULL;
        snprintf(json, sizeof json, "{\"messages\":[{\"role\":\"user\",\"content\":\"m%d\"}]}", i);
        snprintf(want, sizeof want, "<user>m%d", i);
        cJSON *v = cJSON_Parse(json);
        size_t n = 0;
        ck_assert_int_eq(duet__jinja_render(t, v, NULL, &out, &n, err, sizeof err), DUET__JINJA_OK);
        ck_assert_str_eq(out, want);
        ck_assert_uint_eq(n, strlen(want));
        free(out);
        cJSON_Delete(v);
    }
    duet__jinja_free(t);
}
END_TEST

int main(void) {
    Suite *s = suite_create("jinja");
    TCase *tc = tcase_create("jinja");
    tcase_add_test(tc, test_render_like_jinja2);
    tcase_add_test(tc, test_errors);
    tcase_add_test(tc, test_limits);
    tcase_add_test(tc, test_whitespace);
    tcase_add_test(tc, test_reuse);
    tcase_add_test(tc, test_jinja2_tojson);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}

#!/bin/sh
# lsan_tracer_crashes.sh CTEST_LOG: the tests of a ctest --output-on-failure
# log that failed only because LeakSanitizer's own stop-the-world tracer
# crashed at their exit ("Tracer caught signal", then "LeakSanitizer has
# encountered a fatal error": no leak report, google/sanitizers#1353), as a
# regex "^(a|b)$" for ctest -R. Prints nothing when no test failed, or when
# any failed another way (a check, a leak report, a sanitizer error, a
# timeout): those failures stand.
awk '
function close_test() {
    if (name == "") return
    if (tracer && !other) ok = ok (ok == "" ? "" : "|") name
    else bad = 1
    name = ""
}
/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: / || /^ *Start +[0-9]+: / || /tests passed, / {
    close_test()
    if ($0 ~ /Test +#[0-9]+: / && $0 ~ /\*\*\*/) {
        if ($0 !~ /\*\*\*Failed/) { bad = 1; next }
        name = $0
        sub(/^ *[0-9]+\/[0-9]+ Test +#[0-9]+: /, "", name)
        sub(/ .*/, "", name)
        tracer = other = 0
    }
    next
}
name != "" && /Tracer caught signal/ { tracer = 1 }
name != "" && (/detected memory leaks/ || /ERROR: AddressSanitizer/ || /runtime error:/ ||
               /Failures: [1-9]/ || /:F:/ || /^FAIL/ || /Traceback/) { other = 1 }
END { close_test(); if (!bad && ok != "") print "^(" ok ")$" }
' "$1"

# check_tests.cmake — registers each Check test binary with ctest.
#
# A binary whose source creates several test cases (tcase_create("NAME"))
# becomes one ctest test per case, NAME run alone through CK_RUN_CASE: a
# long suite's cases then run side by side under `ctest -j`, each has a
# timeout of its own, and a timeout names the case. A binary with one case
# is one ctest test.
#
# Timeouts come from measurements, not guesses: DUET_TEST_COLD_SECONDS
# holds "test[.case]=seconds" for every test that takes more than a few
# seconds, as measured by `ctest -j2` on a 2-core machine with cold kernel
# caches (PoCL, Mesa and duet compile every kernel variant on first use;
# bench/results/test-suite-cold.md). A test's timeout is three times that plus
# a minute, at least DUET_TEST_MIN_TIMEOUT; twice that under the sanitizers (ASan
# makes oclgrind, whose host side it instruments, 2-3x slower).
# test_util.h prints a "SLOW:" line at 80% of the budget, so a test that
# ends in a timeout has said which case it was and how long it had run.
#
# The same figure is the test's COST: ctest starts the long ones first, so
# that the short ones fill the other core at the end (without cost data, in
# a fresh build folder, it would run them in file order and finish on one).
set(DUET_TEST_MIN_TIMEOUT 300)
set(DUET_TEST_COLD_SECONDS
  test_backend_ops.opencl=400
  test_backend_ops.vulkan_attention=241
  test_eval.py=96
  test_opencl.oclgrind_a=95
  test_opencl.oclgrind_b=86
  test_backend_ops.vulkan=260
  test_backend_ops.opencl_attention=66
  test_server.hardening=30
  test_vulkan.attention=17
  test_quants_reference.py=55
  test_long_context=17
  test_forward.archs=25
  test_engine.faults=14
  test_cpu_ops.ops=11
  test_vulkan.matmul=9
  test_vulkan.validation=9
  test_backend_ops.cpu=9
  test_opencl.api=8
  test_reference.stories260K=8
  test_reference.smollm2=120
  test_duet_bench.py=8
  test_instances.py=38
  test_openai_client.py=20
  test_sampler=7
  test_speculative.distribution=10
  test_engine.speculative_vulkan=60
  test_engine.speculative_opencl=55)

function(duet_test_timing id timeout_out cost_out)
  set(cost 1)
  foreach(entry ${DUET_TEST_COLD_SECONDS})
    if(entry MATCHES "^([^=]+)=([0-9]+)$" AND CMAKE_MATCH_1 STREQUAL id)
      set(cost ${CMAKE_MATCH_2})
    endif()
  endforeach()
  math(EXPR t "3 * ${cost} + 60")
  if(t LESS DUET_TEST_MIN_TIMEOUT)
    set(t ${DUET_TEST_MIN_TIMEOUT})
  endif()
  if(DUET_SANITIZE)
    math(EXPR t "${t} * 2")
  endif()
  set(${timeout_out} ${t} PARENT_SCOPE)
  set(${cost_out} ${cost} PARENT_SCOPE)
endfunction()

function(duet_add_check_test name src)
  file(STRINGS ${src} lines REGEX "tcase_create\\(\"[A-Za-z0-9_]+\"\\)")
  set(cases "")
  foreach(line ${lines})
    string(REGEX MATCHALL "tcase_create\\(\"[A-Za-z0-9_]+\"\\)" calls "${line}")
    foreach(call ${calls})
      string(REGEX REPLACE "tcase_create\\(\"([A-Za-z0-9_]+)\"\\)" "\\1" c "${call}")
      list(APPEND cases ${c})
    endforeach()
  endforeach()
  list(LENGTH cases n)
  if(n LESS 2)
    duet_test_timing(${name} t cost)
    add_test(NAME ${name} COMMAND ${name})
    set_tests_properties(${name} PROPERTIES TIMEOUT ${t} COST ${cost}
      ENVIRONMENT "CK_DEFAULT_TIMEOUT=${t};DUET_TEST_BUDGET=${t};DUET_TEST_NAME=${name}")
    return()
  endif()
  foreach(c ${cases})
    duet_test_timing(${name}.${c} t cost)
    add_test(NAME ${name}.${c} COMMAND ${name})
    set_tests_properties(${name}.${c} PROPERTIES TIMEOUT ${t} COST ${cost}
      ENVIRONMENT "CK_RUN_CASE=${c};CK_DEFAULT_TIMEOUT=${t};DUET_TEST_BUDGET=${t};DUET_TEST_NAME=${name}.${c}")
  endforeach()
endfunction()

# One case of a test binary again on another backend (DUET_TEST_BACKEND),
# as test NAME.CASE_BACKEND: the case's tests run on that backend and skip
# (or fail, where DUET_REQUIRE_BACKENDS names it) when it is unavailable.
function(duet_add_check_case_on name case backend)
  set(id ${name}.${case}_${backend})
  duet_test_timing(${id} t cost)
  add_test(NAME ${id} COMMAND ${name})
  set_tests_properties(${id} PROPERTIES TIMEOUT ${t} COST ${cost}
    ENVIRONMENT "CK_RUN_CASE=${case};DUET_TEST_BACKEND=${backend};CK_DEFAULT_TIMEOUT=${t};DUET_TEST_BUDGET=${t};DUET_TEST_NAME=${id}")
endfunction()

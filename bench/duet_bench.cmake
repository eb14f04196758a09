# duet-bench: the load generator (bench/duet_bench*.c), and its maths in
# the test_bench_stats Check test. Included from the top CMakeLists.txt.
if(NOT TARGET PkgConfig::CURL)
  pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
endif()

set(DUET_BENCH_TOOL_SOURCES
  bench/duet_bench.c
  bench/duet_bench_util.c
  bench/duet_bench_load.c
  bench/duet_bench_stats.c
  bench/duet_bench_http.c
  bench/duet_bench_inproc.c
  bench/duet_bench_sweep.c
  bench/duet_bench_report.c
  bench/duet_bench_timeline.c
  bench/duet_bench_sim.c)
add_executable(duet-bench ${DUET_BENCH_TOOL_SOURCES})
target_link_libraries(duet-bench PRIVATE duet_shared PkgConfig::CJSON PkgConfig::CURL Threads::Threads m)
# The commit recorded in every result file comes from git in this tree.
target_compile_definitions(duet-bench PRIVATE DUET_SOURCE_DIR="${CMAKE_SOURCE_DIR}")

# The percentile, goodput, operating-point, Prometheus and arrival maths
# are tested on fixed data (no HTTP, no engine).
if(TARGET test_bench_stats)
  target_sources(test_bench_stats PRIVATE bench/duet_bench_stats.c bench/duet_bench_load.c bench/duet_bench_util.c)
  target_include_directories(test_bench_stats PRIVATE ${CMAKE_SOURCE_DIR}/bench)
endif()

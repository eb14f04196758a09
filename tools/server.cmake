# server.cmake — build rules of `duet serve` (tools/server*.c, tools/cmd_serve.c)
# and its tests. Included at the end of the top CMakeLists.txt, after the
# `duet` target and the test targets exist.
#
# libmicrohttpd serves HTTP (Debian: libmicrohttpd-dev); libcurl is the test
# client (libcurl4-openssl-dev).
pkg_check_modules(MHD REQUIRED IMPORTED_TARGET libmicrohttpd)
target_link_libraries(duet PRIVATE PkgConfig::MHD)

# The API's OpenAPI description (tools/openapi.json), served at GET /openapi.json.
set(DUET_OPENAPI_EMBEDDED ${CMAKE_BINARY_DIR}/generated/openapi_json.c)
add_custom_command(
  OUTPUT ${DUET_OPENAPI_EMBEDDED}
  COMMAND ${CMAKE_COMMAND} -DIN=${CMAKE_SOURCE_DIR}/tools/openapi.json -DOUT=${DUET_OPENAPI_EMBEDDED}
          -DNAME=srv_openapi_json -P ${CMAKE_SOURCE_DIR}/tools/embed_file.cmake
  DEPENDS ${CMAKE_SOURCE_DIR}/tools/openapi.json ${CMAKE_SOURCE_DIR}/tools/embed_file.cmake
  COMMENT "Embedding the OpenAPI description"
  VERBATIM)
target_sources(duet PRIVATE ${DUET_OPENAPI_EMBEDDED})

if(DUET_TESTS AND TARGET test_server)
  pkg_check_modules(CURL REQUIRED IMPORTED_TARGET libcurl)
  # test_server unit-tests the server's pure parts (parsing, stop strings,
  # JSON) as well as driving a live `duet serve` over HTTP.
  target_sources(test_server PRIVATE
    ${CMAKE_SOURCE_DIR}/tools/server_openai.c)
  target_include_directories(test_server PRIVATE ${CMAKE_SOURCE_DIR}/tools)
  target_link_libraries(test_server PRIVATE PkgConfig::CURL)
  # The live tests start the binary (their timeout: tests/check_tests.cmake).
  add_dependencies(test_server duet)
endif()

# The request fuzzer (tests/fuzz/fuzz_request.c, DUET_FUZZ) drives the same
# pure parts: request parsing, response and stream JSON.
if(TARGET fuzz_request)
  target_sources(fuzz_request PRIVATE
    ${CMAKE_SOURCE_DIR}/tools/server_openai.c)
  target_include_directories(fuzz_request PRIVATE ${CMAKE_SOURCE_DIR}/tools)
endif()

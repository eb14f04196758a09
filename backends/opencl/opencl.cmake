# opencl.cmake — the OpenCL backend's build rules (included by the top-level
# CMakeLists.txt when this file exists).
#
# Needs the OpenCL ICD loader and headers (ocl-icd-opencl-dev,
# opencl-headers) and CLBlast (libclblast-dev). The kernels in kernels/*.cl
# are embedded as byte arrays and compiled at run time for each device.

find_package(OpenCL REQUIRED)
pkg_check_modules(CLBLAST IMPORTED_TARGET clblast)
if(CLBLAST_FOUND)
  set(DUET_CLBLAST PkgConfig::CLBLAST)
else()
  find_library(DUET_CLBLAST_LIB clblast REQUIRED)
  find_path(DUET_CLBLAST_INCLUDE clblast_c.h REQUIRED)
  add_library(duet_clblast INTERFACE)
  target_link_libraries(duet_clblast INTERFACE ${DUET_CLBLAST_LIB})
  target_include_directories(duet_clblast INTERFACE ${DUET_CLBLAST_INCLUDE})
  set(DUET_CLBLAST duet_clblast)
endif()

set(DUET_OCL_DIR ${CMAKE_CURRENT_LIST_DIR})
file(GLOB DUET_OCL_KERNELS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/kernels/*.cl)
list(SORT DUET_OCL_KERNELS)
set(DUET_OCL_EMBEDDED ${CMAKE_BINARY_DIR}/generated/ocl_kernels.c)
add_custom_command(
  OUTPUT ${DUET_OCL_EMBEDDED}
  COMMAND ${CMAKE_COMMAND} -DOUT=${DUET_OCL_EMBEDDED} "-DSOURCES=${DUET_OCL_KERNELS}"
          -P ${DUET_OCL_DIR}/embed.cmake
  DEPENDS ${DUET_OCL_KERNELS} ${DUET_OCL_DIR}/embed.cmake
  COMMENT "Embedding OpenCL kernels"
  VERBATIM)

file(GLOB DUET_OCL_SOURCES CONFIGURE_DEPENDS ${DUET_OCL_DIR}/*.c)
target_sources(duetlib PRIVATE ${DUET_OCL_SOURCES} ${DUET_OCL_EMBEDDED})
set_source_files_properties(${DUET_OCL_EMBEDDED} PROPERTIES INCLUDE_DIRECTORIES ${DUET_OCL_DIR})
target_link_libraries(duetlib PUBLIC OpenCL::OpenCL ${DUET_CLBLAST})
target_compile_definitions(duetlib PRIVATE DUET_BACKEND_OPENCL=1)

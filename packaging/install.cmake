# install.cmake — libduet.so, `cmake --install`, pkg-config and CMake package
# files, and the Debian packages (CPack DEB). Included at the end of the top
# CMakeLists.txt, after every installed target exists.
#
# Installed (GNUInstallDirs): bin/duet, bin/duet-bench (both on libduet.so),
# lib/libduet.so.<soversion> with its namelink, lib/libduet.a,
# include/duet.h, lib/pkgconfig/duet.pc, lib/cmake/duet/ (find_package(duet)
# gives the imported target duet::duet, the shared library).
#
# Packages (`cpack` in the build folder, on Debian): `duet` has the programs
# and the shared library; `libduet-dev` the header, libduet.a, the namelink
# and the pkg-config and CMake files. Configure with
# -DCMAKE_INSTALL_PREFIX=/usr to get Debian's multiarch library folder.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# ---- libduet.so: every object of libduet.a, exporting core/duet.h only ------
# duetlib is compiled position-independent with -fvisibility=hidden, and
# core/duet.h marks its own declarations visible (tests/test_install.py
# compares the exported symbols with the header). The soname changes with
# every release that may break the ABI: the major version, or the minor
# while the major is 0.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(DUET_SOVERSION 0.${PROJECT_VERSION_MINOR})
else()
  set(DUET_SOVERSION ${PROJECT_VERSION_MAJOR})
endif()
add_library(duet_shared SHARED ${CMAKE_CURRENT_LIST_DIR}/libduet.c)
add_library(duet::duet ALIAS duet_shared)
target_link_libraries(duet_shared PRIVATE "$<LINK_LIBRARY:WHOLE_ARCHIVE,duetlib>")
target_include_directories(duet_shared INTERFACE $<BUILD_INTERFACE:${CMAKE_SOURCE_DIR}/core>
                                                 $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
set_target_properties(duet_shared PROPERTIES
  OUTPUT_NAME duet EXPORT_NAME duet VERSION ${PROJECT_VERSION} SOVERSION ${DUET_SOVERSION}
  C_VISIBILITY_PRESET hidden)
# Everything the library needs is linked in (an undefined symbol is a
# build error, not a surprise in some program that loads it).
if(NOT DUET_SANITIZE AND NOT DUET_FUZZ)
  target_link_options(duet_shared PRIVATE -Wl,--no-undefined)
endif()

# The programs find the library next to them (bin/../lib) wherever the
# prefix is; under /usr the dynamic linker finds it anyway.
if(NOT CMAKE_INSTALL_PREFIX STREQUAL "/usr")
  set_target_properties(duet duet-bench PROPERTIES INSTALL_RPATH "$ORIGIN/../${CMAKE_INSTALL_LIBDIR}")
endif()

# ---- cmake --install --------------------------------------------------------
install(TARGETS duet duet-bench RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR} COMPONENT runtime)
install(TARGETS duet_shared EXPORT duetTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT runtime NAMELINK_COMPONENT dev)
install(TARGETS duetlib ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR} COMPONENT dev)
install(FILES ${CMAKE_SOURCE_DIR}/core/duet.h DESTINATION ${CMAKE_INSTALL_INCLUDEDIR} COMPONENT dev)
# The default model's fetcher, which `duet run` without -m points to.
install(PROGRAMS ${CMAKE_SOURCE_DIR}/tools/fetch_smollm2.sh DESTINATION ${CMAKE_INSTALL_DATADIR}/duet COMPONENT runtime)
target_compile_definitions(duet PRIVATE DUET_INSTALL_DATADIR="${CMAKE_INSTALL_FULL_DATADIR}/duet")
install(FILES ${CMAKE_SOURCE_DIR}/LICENSE ${CMAKE_SOURCE_DIR}/README.md DESTINATION ${CMAKE_INSTALL_DOCDIR}
        COMPONENT runtime)

# duet.pc is written at install time, so that its prefix is the one installed
# to (`cmake --install --prefix P`, or /usr inside a package).
set(DUET_PC_REQUIRES_PRIVATE "libpcre2-8 libcjson")
if(TARGET OpenCL::OpenCL)
  string(APPEND DUET_PC_REQUIRES_PRIVATE " OpenCL")
endif()
if(CLBLAST_FOUND)
  string(APPEND DUET_PC_REQUIRES_PRIVATE " clblast")
endif()
set(DUET_PC_LIBS_PRIVATE "-lm -pthread")
if(CMAKE_DL_LIBS)
  string(PREPEND DUET_PC_LIBS_PRIVATE "-l${CMAKE_DL_LIBS} ")
endif()
if(DUET_CLBLAST_LIB)
  string(APPEND DUET_PC_LIBS_PRIVATE " ${DUET_CLBLAST_LIB}")
endif()
set(DUET_PC_PREFIX "@DUET_PC_PREFIX@") # filled in at install time
configure_file(${CMAKE_CURRENT_LIST_DIR}/duet.pc.in ${CMAKE_BINARY_DIR}/packaging/duet.pc.in @ONLY)
install(CODE "set(DUET_PC_PREFIX \"\${CMAKE_INSTALL_PREFIX}\")
configure_file(\"${CMAKE_BINARY_DIR}/packaging/duet.pc.in\" \"${CMAKE_BINARY_DIR}/packaging/duet.pc\" @ONLY)"
        COMPONENT dev)
install(FILES ${CMAKE_BINARY_DIR}/packaging/duet.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig COMPONENT dev)

# find_package(duet) -> duet::duet (relocatable: found from its own folder).
set(DUET_CMAKE_DIR ${CMAKE_INSTALL_LIBDIR}/cmake/duet)
install(EXPORT duetTargets NAMESPACE duet:: DESTINATION ${DUET_CMAKE_DIR} COMPONENT dev)
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/duetConfig.cmake.in
  ${CMAKE_BINARY_DIR}/packaging/duetConfig.cmake INSTALL_DESTINATION ${DUET_CMAKE_DIR})
# 0.x releases may break the API with each minor version.
if(PROJECT_VERSION_MAJOR EQUAL 0)
  set(duet_compat SameMinorVersion)
else()
  set(duet_compat SameMajorVersion)
endif()
write_basic_package_version_file(${CMAKE_BINARY_DIR}/packaging/duetConfigVersion.cmake
  COMPATIBILITY ${duet_compat})
install(FILES ${CMAKE_BINARY_DIR}/packaging/duetConfig.cmake ${CMAKE_BINARY_DIR}/packaging/duetConfigVersion.cmake
        DESTINATION ${DUET_CMAKE_DIR} COMPONENT dev)

# ---- Debian packages (cpack -G DEB) -----------------------------------------
set(CPACK_GENERATOR DEB)
set(CPACK_PACKAGE_NAME duet)
set(CPACK_PACKAGE_VENDOR "duet")
set(CPACK_PACKAGE_CONTACT "duet maintainers <duet@localhost>")
set(CPACK_RESOURCE_FILE_LICENSE ${CMAKE_SOURCE_DIR}/LICENSE)
set(CPACK_STRIP_FILES ON)
set(CPACK_COMPONENTS_ALL runtime dev)
set(CPACK_DEB_COMPONENT_INSTALL ON)
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
# Run-time dependencies of the programs and libduet.so come from their ELF
# dependencies (dpkg-shlibdeps): libc, PCRE2, cJSON, the OpenCL ICD loader,
# CLBlast, libmicrohttpd, libcurl. The Vulkan loader is not among them
# (volk dlopens it, so a machine without one still runs the other backends),
# hence named here. The drivers that give every machine a device (lavapipe,
# PoCL) are recommended.
set(CPACK_DEBIAN_RUNTIME_PACKAGE_NAME duet)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SHLIBDEPS ON)
set(CPACK_DEBIAN_RUNTIME_PACKAGE_DEPENDS "libvulkan1")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_RECOMMENDS "mesa-vulkan-drivers, pocl-opencl-icd")
set(CPACK_DEBIAN_RUNTIME_PACKAGE_SECTION science)
# (Each description's first line is the package's summary.)
set(CPACK_DEBIAN_RUNTIME_DESCRIPTION "LLM inference engine for CPUs and Vulkan and OpenCL GPUs
duet runs GGUF models (llama, mistral, qwen2) on the CPU, on any Vulkan
GPU and on any OpenCL device, chosen at run time. This package has the
duet command (run, chat, serve an OpenAI-compatible API, quantize, eval),
the duet-bench load generator and the shared library libduet.")
# The header, the static library and the files that find them; what
# libduet.a needs at link time (duet.pc's Requires.private).
set(CPACK_DEBIAN_DEV_PACKAGE_NAME libduet-dev)
set(CPACK_DEBIAN_DEV_PACKAGE_DEPENDS
    "duet (= ${PROJECT_VERSION}), libpcre2-dev, libcjson-dev, ocl-icd-opencl-dev, libclblast-dev")
set(CPACK_DEBIAN_DEV_PACKAGE_RECOMMENDS "pkg-config")
set(CPACK_DEBIAN_DEV_PACKAGE_SECTION libdevel)
set(CPACK_DEBIAN_DEV_DESCRIPTION "LLM inference engine duet: C development files
The header duet.h, the static library libduet.a and the development link
to libduet.so, with the pkg-config file duet.pc and the CMake package
(find_package(duet) gives the target duet::duet).")
include(CPack)

# vulkan.cmake — the Vulkan backend's build rules (included by the top-level
# CMakeLists.txt when this file exists).
#
# Needs: glslc (shaderc) to compile shaders/*.comp to SPIR-V at build time,
# spirv-val (spirv-tools) to validate them, the Vulkan headers and volk
# (libvulkan-volk-dev: volk.h + volk.c). volk loads libvulkan at run time, so
# the library has no link-time dependency on the Vulkan loader: a machine
# without one gets "vulkan: unavailable (...)" and every other backend works.
#
# Each shader variant is one source built with -D defines; glslc writes a
# dependency file (-MD) so editing an included .glsl rebuilds only the
# variants that use it. The SPIR-V words are embedded as aligned uint32_t
# arrays by embed_spirv.cmake (a CMake script: no Python at build time).

find_program(DUET_GLSLC glslc)
find_program(DUET_SPIRV_VAL spirv-val)
find_path(DUET_VOLK_INCLUDE volk.h)
find_file(DUET_VOLK_SOURCE volk.c PATHS ${DUET_VOLK_INCLUDE} NO_DEFAULT_PATH)
find_path(DUET_VULKAN_INCLUDE vulkan/vulkan.h)

set(duet_vk_missing "")
foreach(v DUET_GLSLC DUET_VOLK_INCLUDE DUET_VOLK_SOURCE DUET_VULKAN_INCLUDE)
  if(NOT ${v})
    list(APPEND duet_vk_missing ${v})
  endif()
endforeach()
if(duet_vk_missing)
  message(WARNING "Vulkan backend not built (missing: ${duet_vk_missing}); "
                  "install glslc libvulkan-dev libvulkan-volk-dev spirv-tools")
  return()
endif()
if(NOT DUET_SPIRV_VAL)
  message(WARNING "spirv-val not found: shaders are compiled but not validated")
endif()

set(DUET_VK_DIR ${CMAKE_CURRENT_LIST_DIR})
set(DUET_VK_SHADER_DIR ${CMAKE_SOURCE_DIR}/shaders)
set(DUET_VK_GEN ${CMAKE_BINARY_DIR}/generated/vulkan)
file(MAKE_DIRECTORY ${DUET_VK_GEN})
set(DUET_VK_TARGET_ENV vulkan1.2)

# A glslc that knows GL_EXT_integer_dot_product gets it; older ones (Debian
# 12's glslang 11/12) reach OpSDotAccSat through GL_EXT_spirv_intrinsics.
set(duet_vk_probe ${DUET_VK_GEN}/probe_int_dot.comp)
file(WRITE ${duet_vk_probe} "#version 450
#extension GL_EXT_integer_dot_product : require
layout(local_size_x = 1) in;
layout(std430, binding = 0) buffer B { int v[]; };
void main() { v[0] = dotPacked4x8AccSatEXT(uint(v[1]), uint(v[2]), v[3]); }
")
execute_process(COMMAND ${DUET_GLSLC} --target-env=${DUET_VK_TARGET_ENV} -c ${duet_vk_probe} -o ${DUET_VK_GEN}/probe_int_dot.spv
                RESULT_VARIABLE duet_vk_probe_rc OUTPUT_QUIET ERROR_QUIET)
set(DUET_VK_GLSL_DEFS "")
if(duet_vk_probe_rc EQUAL 0)
  list(APPEND DUET_VK_GLSL_DEFS -DHAVE_EXT_INTEGER_DOT=1)
endif()

# name | source | defines (space separated).  One line per SPIR-V module.
set(DUET_VK_VARIANTS
  "embed|embed.comp|"
  "rmsnorm|rmsnorm.comp|"
  "quantize_q8|quantize_q8.comp|"
  "matmul_tile_f32|matmul_tile.comp|-DWTYPE_F32=1"
  "matmul_tile_f16|matmul_tile.comp|-DWTYPE_F16=1"
  "matmul_tile_bf16|matmul_tile.comp|-DWTYPE_BF16=1"
  "matmul_tile_q8_0|matmul_tile_q8.comp|"
  "matmul_tile_q8_0_dot|matmul_tile_q8.comp|-DUSE_INT_DOT=1"
  "matmul_sg_f32|matmul_sg.comp|-DWTYPE_F32=1"
  "matmul_sg_f16|matmul_sg.comp|-DWTYPE_F16=1"
  "matmul_sg_bf16|matmul_sg.comp|-DWTYPE_BF16=1"
  "matmul_sg_q8_0|matmul_sg.comp|-DWTYPE_Q8_0=1"
  "matmul_sg_q8_0_dot|matmul_sg.comp|-DWTYPE_Q8_0=1 -DUSE_INT_DOT=1"
  "matmul_mm_q8_0|matmul_mm_q8.comp|"
  "matmul_mm_q8_0_dot|matmul_mm_q8.comp|-DUSE_INT_DOT=1"
  "matmul_tile_blk|matmul_tile_blk.comp|"
  "matmul_tile_blk_dot|matmul_tile_blk.comp|-DUSE_INT_DOT=1"
  "matmul_sg_blk|matmul_sg.comp|-DWTYPE_BLK=1"
  "matmul_sg_blk_dot|matmul_sg.comp|-DWTYPE_BLK=1 -DUSE_INT_DOT=1"
  "matmul_mm_blk|matmul_mm_blk.comp|"
  "matmul_mm_blk_dot|matmul_mm_blk.comp|-DUSE_INT_DOT=1"
  "rope_kv|rope_kv.comp|"
  "attn_flash|attn_flash.comp|-DUSE_SHUFFLE=1"
  "attn_flash_noshuffle|attn_flash.comp|"
  "attn_lane|attn_lane.comp|-DUSE_SHUFFLE=1"
  "attn_lane_noshuffle|attn_lane.comp|"
  "attn_reduce|attn_reduce.comp|"
  "swiglu|elementwise.comp|-DOP_SWIGLU=1"
  "add|elementwise.comp|-DOP_ADD=1"
  "gather_rows|gather_rows.comp|"
  "argmax|argmax.comp|"
)

set(duet_vk_spv_files "")
set(duet_vk_names "")
foreach(entry IN LISTS DUET_VK_VARIANTS)
  string(REPLACE "|" ";" parts "${entry}")
  list(GET parts 0 name)
  list(GET parts 1 src)
  list(LENGTH parts nparts)
  set(defs "")
  if(nparts GREATER 2)
    list(GET parts 2 defstr)
    separate_arguments(defs UNIX_COMMAND "${defstr}")
  endif()
  set(spv ${DUET_VK_GEN}/${name}.spv)
  set(val_cmd "")
  if(DUET_SPIRV_VAL)
    set(val_cmd COMMAND ${DUET_SPIRV_VAL} --target-env ${DUET_VK_TARGET_ENV} ${spv})
  endif()
  add_custom_command(
    OUTPUT ${spv}
    COMMAND ${DUET_GLSLC} --target-env=${DUET_VK_TARGET_ENV} -O -Werror
            -I ${DUET_VK_SHADER_DIR} ${DUET_VK_GLSL_DEFS} ${defs}
            -MD -MF ${spv}.d -MT ${spv}
            -o ${spv} ${DUET_VK_SHADER_DIR}/${src}
    ${val_cmd}
    DEPENDS ${DUET_VK_SHADER_DIR}/${src}
    DEPFILE ${spv}.d
    COMMENT "SPIR-V ${name}"
    VERBATIM)
  list(APPEND duet_vk_spv_files ${spv})
  list(APPEND duet_vk_names ${name})
endforeach()

set(DUET_VK_EMBEDDED ${DUET_VK_GEN}/vk_spirv.c)
add_custom_command(
  OUTPUT ${DUET_VK_EMBEDDED}
  COMMAND ${CMAKE_COMMAND} -DOUT=${DUET_VK_EMBEDDED} "-DNAMES=${duet_vk_names}" -DDIR=${DUET_VK_GEN}
          -P ${DUET_VK_DIR}/embed_spirv.cmake
  DEPENDS ${duet_vk_spv_files} ${DUET_VK_DIR}/embed_spirv.cmake
  COMMENT "Embedding SPIR-V"
  VERBATIM)

# The module list as an enum the C code indexes (written at configure time).
set(hdr "/* Generated by backends/vulkan/vulkan.cmake: do not edit. */\n")
string(APPEND hdr "#ifndef DUET_VK_SPIRV_H\n#define DUET_VK_SPIRV_H\n#include <stddef.h>\n#include <stdint.h>\n\n")
string(APPEND hdr "typedef enum vk_shader {\n")
foreach(name IN LISTS duet_vk_names)
  string(TOUPPER ${name} up)
  string(APPEND hdr "    VK_SHADER_${up},\n")
endforeach()
string(APPEND hdr "    VK_SHADER_COUNT\n} vk_shader;\n\n")
string(APPEND hdr "typedef struct vk_spirv {\n    const char *name;\n    const uint32_t *code;\n    size_t size; /* bytes */\n} vk_spirv;\n\n")
string(APPEND hdr "extern const vk_spirv duet__vk_spirv[VK_SHADER_COUNT];\n\n#endif\n")
file(WRITE ${DUET_VK_GEN}/vk_spirv.h.tmp "${hdr}")
file(COPY_FILE ${DUET_VK_GEN}/vk_spirv.h.tmp ${DUET_VK_GEN}/vk_spirv.h ONLY_IF_DIFFERENT)
file(REMOVE ${DUET_VK_GEN}/vk_spirv.h.tmp)

file(GLOB DUET_VK_SOURCES CONFIGURE_DEPENDS ${DUET_VK_DIR}/*.c)
target_sources(duetlib PRIVATE ${DUET_VK_SOURCES} ${DUET_VK_EMBEDDED} ${DUET_VOLK_SOURCE})
target_include_directories(duetlib PRIVATE ${DUET_VK_GEN} ${DUET_VOLK_INCLUDE} ${DUET_VULKAN_INCLUDE})
# volk is third-party code: compile it as shipped, without our warnings.
set_source_files_properties(${DUET_VOLK_SOURCE} PROPERTIES COMPILE_OPTIONS "-w")
target_compile_definitions(duetlib PRIVATE DUET_BACKEND_VULKAN=1 VK_NO_PROTOTYPES)
target_link_libraries(duetlib PUBLIC ${CMAKE_DL_LIBS})

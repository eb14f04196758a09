#!/bin/sh
# entrypoint.sh — the image's entrypoint: finds the GPU the node gave the
# container, points the loaders at it, then runs `duet "$@"` (exec, so duet
# gets SIGTERM from the kubelet and drains).
#
# NVIDIA: the container toolkit mounts the driver's ICD files when
# NVIDIA_DRIVER_CAPABILITIES includes graphics (Vulkan) and compute
# (OpenCL, CUDA); some Vulkan loaders only look where VK_ICD_FILENAMES (old
# loaders) or VK_DRIVER_FILES (1.3.234 and newer) say, so both name the
# mounted nvidia_icd.json, with lavapipe after it as the fallback.
# AMD: /dev/dri/renderD* (Vulkan through Mesa's RADV, in the image) and
# /dev/kfd (ROCm's OpenCL, when its ICD is mounted into
# /etc/OpenCL/vendors) need the render group: run with it as a
# supplemental group. DUET_ENTRYPOINT_QUIET=1 silences the report.
set -eu

say() { [ "${DUET_ENTRYPOINT_QUIET:-0}" = 1 ] || echo "duet-entrypoint: $*" >&2; }

# The Vulkan ICD manifest of the NVIDIA driver, wherever the toolkit put it.
nvidia_icd=""
for f in /etc/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json \
    /etc/vulkan/icd.d/nvidia_icd.x86_64.json /usr/share/vulkan/icd.d/nvidia_icd.x86_64.json \
    /usr/local/nvidia/icd.d/nvidia_icd.json; do
    if [ -r "$f" ]; then
        nvidia_icd="$f"
        break
    fi
done

caps="${NVIDIA_DRIVER_CAPABILITIES:-}"
has_cap() { case ",$caps," in *",$1,"* | *",all,"*) return 0 ;; *) return 1 ;; esac; }

if [ -n "$nvidia_icd" ]; then
    if [ -z "${VK_ICD_FILENAMES:-}${VK_DRIVER_FILES:-}" ]; then
        lvp=""
        for f in /usr/share/vulkan/icd.d/lvp_icd.*.json; do [ -r "$f" ] && lvp="$f"; done
        export VK_DRIVER_FILES="$nvidia_icd${lvp:+:$lvp}"
        export VK_ICD_FILENAMES="$VK_DRIVER_FILES"
    fi
    say "NVIDIA: Vulkan ICD $nvidia_icd"
elif [ -e /dev/nvidia0 ]; then
    say "NVIDIA device present but no Vulkan ICD mounted: NVIDIA_DRIVER_CAPABILITIES must include graphics" \
        "(it is '$caps'); falling back to the other devices"
fi
if [ -e /dev/nvidia0 ] && ! { has_cap compute && has_cap graphics && has_cap utility; }; then
    say "NVIDIA_DRIVER_CAPABILITIES='$caps' lacks one of compute,graphics,utility"
fi

# AMD: say what is missing rather than fail deep in a driver.
if [ -e /dev/kfd ] || ls /dev/dri/renderD* >/dev/null 2>&1; then
    for node in /dev/kfd /dev/dri/renderD*; do
        [ -e "$node" ] || continue
        if [ -r "$node" ] && [ -w "$node" ]; then
            say "device $node usable"
        else
            say "device $node is not readable and writable by uid $(id -u) (groups $(id -G)):" \
                "add its group ($(stat -c %g "$node")) to the pod's supplementalGroups"
        fi
    done
fi

case "${1:-}" in
"" | -*) set -- serve "$@" ;;
esac
exec duet "$@"

#!/usr/bin/env bash
# make test's set-up step for the webgpu backend's tests: a Vulkan driver for wgpu to find. On a
# machine without a GPU that is Mesa's lavapipe (Debian's mesa-vulkan-drivers), installed where
# this machine can (root with apt-get). Elsewhere it says how, and the webgpu tests skip saying
# why (no adapter); it never fails the set-up.
set -u
if ls /usr/share/vulkan/icd.d/*.json /etc/vulkan/icd.d/*.json >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mesa-vulkan-drivers libvulkan1 >/tmp/yirage-webgpu-install.log 2>&1 \
        || { apt-get update -q >>/tmp/yirage-webgpu-install.log 2>&1 && \
             DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends mesa-vulkan-drivers libvulkan1 >>/tmp/yirage-webgpu-install.log 2>&1; }; then
        echo "installed mesa-vulkan-drivers (lavapipe: the webgpu backend's tests)"
        exit 0
    fi
    echo "warning: could not install mesa-vulkan-drivers (see /tmp/yirage-webgpu-install.log): the webgpu tests will skip"
    exit 0
fi
echo "note: the webgpu tests need a Vulkan driver (Debian/Ubuntu without a GPU: sudo apt-get install mesa-vulkan-drivers); they will skip"
exit 0

#!/usr/bin/env bash
# make test's set-up step for the aarch64 kernel tests (tests/cross): Debian's cross compiler and
# qemu-user, installed where this machine can (root with apt-get). Elsewhere it says how, and
# those tests skip with the same words; it never fails the set-up.
set -u
if command -v aarch64-linux-gnu-g++ >/dev/null && command -v qemu-aarch64 >/dev/null; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    if DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu qemu-user >/tmp/yirage-cross-install.log 2>&1 \
        || { apt-get update -q >>/tmp/yirage-cross-install.log 2>&1 && \
             DEBIAN_FRONTEND=noninteractive apt-get install -y -q g++-aarch64-linux-gnu qemu-user >>/tmp/yirage-cross-install.log 2>&1; }; then
        echo "installed g++-aarch64-linux-gnu and qemu-user (the aarch64 kernel tests)"
        exit 0
    fi
    echo "warning: could not install g++-aarch64-linux-gnu and qemu-user (see /tmp/yirage-cross-install.log): the aarch64 kernel tests will skip"
    exit 0
fi
echo "note: the aarch64 kernel tests need g++-aarch64-linux-gnu and qemu-user (Debian/Ubuntu: sudo apt-get install g++-aarch64-linux-gnu qemu-user); they will skip"
exit 0

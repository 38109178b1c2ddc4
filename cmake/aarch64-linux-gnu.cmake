# Cross toolchain for aarch64 Linux (Debian's g++-aarch64-linux-gnu). Used by
# tests/test_arm_qemu.py; binaries run under qemu-aarch64.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
# Static executables: qemu-aarch64 then needs no aarch64 sysroot at run time.
set(CMAKE_EXE_LINKER_FLAGS_INIT "-static")

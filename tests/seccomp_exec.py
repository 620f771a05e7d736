"""``python tests/seccomp_exec.py COMMAND ARGS...``: exec COMMAND under a seccomp filter that refuses
``process_vm_readv`` and ``process_vm_writev`` with EPERM (and allows everything else), as a container
runtime's seccomp profile may; the filter is inherited by every process COMMAND starts. Uses the
system's libseccomp through ctypes; exits 3 when it is missing (``available()`` checks first)."""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_ERRNO_BASE = 0x00050000
EPERM = 1
REFUSED = (b"process_vm_readv", b"process_vm_writev")


def _lib():
    name = ctypes.util.find_library("seccomp")
    if name is None:
        return None
    lib = ctypes.CDLL(name)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    return lib


def available() -> bool:
    """libseccomp can be loaded here."""
    return _lib() is not None


def main(argv: list[str]) -> int:
    lib = _lib()
    if lib is None:
        print("seccomp_exec: libseccomp not found", file=sys.stderr)
        return 3
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    for name in REFUSED:
        if lib.seccomp_rule_add(ctx, SCMP_ACT_ERRNO_BASE | EPERM, lib.seccomp_syscall_resolve_name(name), 0) != 0:
            print(f"seccomp_exec: cannot add a rule for {name.decode()}", file=sys.stderr)
            return 3
    if lib.seccomp_load(ctx) != 0:
        print("seccomp_exec: seccomp_load failed", file=sys.stderr)
        return 3
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Every environment variable flashjit reads, each through one typed accessor.

============================  =====================  ==========================================  ===========================
Variable                      Accessor               Meaning                                     Unset or empty
============================  =====================  ==========================================  ===========================
FLASHJIT_CACHE_DIR            cache_dir()            root of the kernel cache (``~`` expanded)   None: the user cache folder
FLASHJIT_NO_COMPILE           no_compile()           flag: a kernel missing from the cache       off
                                                     raises KernelNotPrewarmed instead of being
                                                     compiled (``Engine(allow_compile=...)``
                                                     wins)
FLASHJIT_LOCK_TIMEOUT         lock_timeout()         seconds to wait for another process's       120
                                                     build of the same artifact before building
                                                     anyway; a number from 0 to 86400 (a day)
FLASHJIT_TEMPLATE_PATH        template_path()        folders of extra mask templates, separated  no folders
                                                     by ``os.pathsep``
FLASHJIT_HOST_NATIVE          host_native()          flag: build and use the C host helpers      on
                                                     (off: their numpy versions)
CC                            cc()                   the C compiler command of the host          ``cc``
                                                     helpers, shell-quoted words (e.g.
                                                     ``ccache gcc -m64``)
CXX                           cxx()                  the C++ compiler of the mask checker's      ``c++``
                                                     host replay (one program)
CUDA_HOME, CUDA_PATH          cuda_toolkit()         CUDA toolkit folders; they name the NVRTC   ""
                                                     when no NVRTC wheel is installed
FLASHJIT_VLLM_DECODE_Q_LEN    vllm_decode_q_len()    the vLLM backend runs rows of up to this    None: 1 + the speculative
                                                     many query tokens on flashjit (1..16),      tokens
                                                     longer ones on FlashAttention
FLASHJIT_VLLM_SHARE_PREFIXES  vllm_share_prefixes()  flag: the vLLM backend reads blocks that    on
                                                     neighbouring requests share once (off: its
                                                     plans never wait for the GPU)
FLASHJIT_VLLM_FP8_QUERIES     vllm_fp8_queries()     flag: over an e4m3 cache the vLLM backend   on
                                                     asks vLLM for e4m3 queries, as vLLM's
                                                     FlashAttention does (off: 16-bit queries,
                                                     cast for the prefill rows)
============================  =====================  ==========================================  ===========================

A flag reads 1, true, yes, on as on and 0, false, no, off as off, in any case and with spaces around
ignored (parse_flag). A value an accessor does not accept gives that variable's default and one
warning per value on the 'flashjit' logger: a typo never stops a server, and never goes unnoticed.
Every accessor reads the environment at each call, so a variable set after import still counts.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

DEFAULT_LOCK_TIMEOUT_S = 120.0
MAX_LOCK_TIMEOUT_S = 86400.0  # longer is no timeout at all: a stopped peer would be waited for forever
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

log = logging.getLogger("flashjit")
_warned: set[tuple[str, str]] = set()  # (variable, value) pairs already warned about
_warned_lock = threading.Lock()


def parse_flag(text: str) -> bool | None:
    """True for TRUE_WORDS, False for FALSE_WORDS (any case, spaces around ignored), else None."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None


def cache_dir() -> Path | None:
    """FLASHJIT_CACHE_DIR with ``~`` expanded, or None when it is unset or empty."""
    text = os.environ.get("FLASHJIT_CACHE_DIR", "")
    return Path(text).expanduser() if text else None


def no_compile() -> bool:
    """FLASHJIT_NO_COMPILE as a flag; off by default."""
    return _flag("FLASHJIT_NO_COMPILE", default=False)


def lock_timeout() -> float:
    """FLASHJIT_LOCK_TIMEOUT in seconds; DEFAULT_LOCK_TIMEOUT_S when unset, empty, not a number, or
    outside 0 to MAX_LOCK_TIMEOUT_S."""
    text = os.environ.get("FLASHJIT_LOCK_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if 0 <= value <= MAX_LOCK_TIMEOUT_S:  # also rejects nan and inf
        return value
    _warn_once("FLASHJIT_LOCK_TIMEOUT", text, "is not a number of seconds from 0 to %.0f; using %.0f"
               % (MAX_LOCK_TIMEOUT_S, DEFAULT_LOCK_TIMEOUT_S))
    return DEFAULT_LOCK_TIMEOUT_S


def template_path() -> list[Path]:
    """The folders named by FLASHJIT_TEMPLATE_PATH, in order; empty entries are skipped."""
    return [Path(part) for part in os.environ.get("FLASHJIT_TEMPLATE_PATH", "").split(os.pathsep) if part]


def host_native() -> bool:
    """FLASHJIT_HOST_NATIVE as a flag; on by default."""
    return _flag("FLASHJIT_HOST_NATIVE", default=True)


def cc() -> str:
    """$CC with spaces around removed; "" when unset (the host helpers then build with ``cc``)."""
    return os.environ.get("CC", "").strip()


def cxx() -> str:
    """$CXX with spaces around removed; "" when unset (the mask checker then uses ``c++``)."""
    return os.environ.get("CXX", "").strip()


def cuda_toolkit() -> tuple[str, str]:
    """($CUDA_HOME, $CUDA_PATH), each "" when unset."""
    return os.environ.get("CUDA_HOME", ""), os.environ.get("CUDA_PATH", "")


def vllm_decode_q_len() -> int | None:
    """FLASHJIT_VLLM_DECODE_Q_LEN, an int in 1..16; None when unset, empty or another value."""
    text = os.environ.get("FLASHJIT_VLLM_DECODE_Q_LEN", "").strip()
    if not text:
        return None
    if text.isdigit() and 1 <= int(text) <= 16:
        return int(text)
    _warn_once("FLASHJIT_VLLM_DECODE_Q_LEN", text, "is not a query-token count in 1..16; using 1 + the "
               "speculative tokens")
    return None


def vllm_share_prefixes() -> bool:
    """FLASHJIT_VLLM_SHARE_PREFIXES as a flag; on by default."""
    return _flag("FLASHJIT_VLLM_SHARE_PREFIXES", default=True)


def vllm_fp8_queries() -> bool:
    """FLASHJIT_VLLM_FP8_QUERIES as a flag; on by default."""
    return _flag("FLASHJIT_VLLM_FP8_QUERIES", default=True)


def _flag(name: str, default: bool) -> bool:
    text = os.environ.get(name, "")
    if not text.strip():
        return default
    value = parse_flag(text)
    if value is None:
        words = "/".join(TRUE_WORDS) + " or " + "/".join(FALSE_WORDS)
        _warn_once(name, text, f"is not one of {words}; using {'on' if default else 'off'}")
        return default
    return value


def _warn_once(name: str, text: str, why: str):
    with _warned_lock:
        if (name, text) in _warned:
            return
        _warned.add((name, text))
    log.warning("%s=%r %s", name, text, why)

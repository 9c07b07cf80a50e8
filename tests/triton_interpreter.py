"""Triton's CPU interpreter with its language patched once per launch instead of at every device-function call.

The interpreter (triton/runtime/interpreter.py) maps triton.language onto numpy by patching the language modules
(`_patch_lang`) when a launch starts, and restores them when it ends. It calls `_patch_lang` again at every call of a
`@triton.jit` device function (`InterpretedFunction.__call__`), inside the launch, where the modules are already
patched: it finds no builtin left to replace, sets the same stateless closures again, and returns a scope nobody
restores. Each call walks the language modules with `inspect.getmembers` (~2 ms), and the kernels call small device
functions (`round_to`, the codecs' stores) per program, so this repeat was ~40% of the interpreter tests' time
(tests/v4_glue_cases.py's tiny models: 85 s -> 53 s). `patch_lang_once_per_launch` skips it where the device
function sees no language module the launch has not patched; what runs, and what every op computes, is unchanged.

The interpreter tests' case files call it when they run in the interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import inspect
import os


def patch_lang_once_per_launch() -> None:
    """Make device-function calls inside a launch skip `_patch_lang` when the launch already patched the language
    modules their globals see (no-op outside TRITON_INTERPRET=1, or on a Triton without these internals)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or getattr(patch, "once_per_launch", False) or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: set[int] = set()       # the language modules the launch in progress patched (empty: no launch)

    def patch_lang(fn):
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched:        # a device function inside the launch: nothing left to patch
            return interpreter._LangPatchScope()
        launch = not patched
        scope = patch(fn)
        patched.update(langs)
        if launch:                              # the launch's scope: forget the modules when it restores them
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()
            scope.restore = restore_and_forget
        return scope

    patch_lang.once_per_launch = True
    interpreter._patch_lang = patch_lang

"""The user's step compiled after each of its graph breaks, however it names its objects.

After a graph break Dynamo runs the rest of the function in a resume frame it generates, and it
skips, running eagerly, any frame that holds no tensor or module and names no ``torch`` module.
``torch.compile`` exempts only the function it was given. A step written at module level, whose
model, optimizer, batch and hand-written loss are globals, has such a resume frame after the
zero-grad's break: its forward and loss would run eagerly, each function they call compiled on
its own, the loss apart from the LM head (no fused cross-entropy: the full logits in memory).
``compiled_resumes`` exempts the resume frames generated from the step's code, and from those.
A break Dynamo cannot resume from at all (``loss.backward()`` inside a loop) makes it run the step's
own frame eagerly; ``ran_eagerly`` tells, for the pass report. The step's gradient-accumulation loop
bodies, run as functions of their own (``accumulation_loops.py``), are compiled as the step is.
"""
import contextlib
import types
from collections.abc import Sequence

from torch_internals import dynamo


@contextlib.contextmanager
def compiled_resumes(code: types.CodeType | None, bodies: Sequence[types.CodeType] = ()):
    """While active, each resume frame Dynamo generates from ``code`` or from one of ``bodies`` (or
    from one of those) is compiled as ``code`` is, tensors in it or not, and so are ``bodies``.
    None: nothing changes."""
    cache, exempt = dynamo.resume_frame_cache(), dynamo.always_optimized_codes()
    if code is None or cache is None or exempt is None:  # a torch without them
        yield
        return
    original = vars(cache)["lookup"]
    ours = [code, *bodies]  # by identity: equal code objects of other functions are not ours
    for body in bodies:
        exempt[body] = True

    def lookup(klass, resumed, *args, **kwargs):
        resume = original.__func__(klass, resumed, *args, **kwargs)
        if any(resumed is c for c in ours) and isinstance(resume, types.CodeType):
            ours.append(resume)
            exempt[resume] = True
        return resume

    cache.lookup = classmethod(lookup)
    try:
        yield
    finally:
        cache.lookup = original


def ran_eagerly(code: types.CodeType | None) -> bool:
    """Whether Dynamo ran the frame of ``code`` eagerly: after a call it holds no compiled entry."""
    if code is None:
        return False
    entries = dynamo.cache_entries(code)
    return entries is not None and not entries

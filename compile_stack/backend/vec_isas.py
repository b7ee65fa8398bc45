"""The host's vector ISAs, probed once per cache directory rather than once per process.

Before Inductor loads or builds a CPU graph's C++ kernels it probes which vector
ISAs the host can build and load: a compile and a Python process per ISA, ~1.4 s
of every start on a 2-core CPU host (more than a warm start's tracing). Its answer
depends only on the torch build, the C++ compiler and the CPU, so the first process
records it beside Inductor's caches with those as the key, and a later process on
the same host hands Inductor that answer instead of probing again. A record made
with another torch, compiler or CPU (a cache directory shared between hosts), or
one that does not parse, is not used: Inductor probes, and the record is replaced.
A fresh cache deletes the record with Inductor's caches.
"""
from pathlib import Path

from compile_stack.caches import read_record, write_record
from torch_internals import inductor

RECORD = "vec_isas.json"


def recall() -> None:
    """Make Inductor's answer for the host's vector ISAs known in this process: from the record
    in Inductor's cache directory if it was made on this host, else by Inductor's probe, whose
    answer is then recorded. Nothing if Inductor has an answer already (or is told one)."""
    if inductor.vec_isas_answered():
        return
    path = Path(inductor.cache_dir()) / RECORD
    host = inductor.vec_isa_host()
    record = read_record(path)
    if isinstance(record, dict) and record.get("host") == host and isinstance(record.get("valid"), list):
        inductor.assume_vec_isas(record["valid"])
    else:
        write_record(path, {"host": host, "valid": inductor.probe_vec_isas()})

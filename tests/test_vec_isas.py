"""The host's vector ISAs: probed by the first process on a cache directory, read by later ones,
and probed again wherever the record is not this host's."""
import json

import pytest
import torch
from torch._inductor import cpu_vec_isa

from compile_stack.backend import vec_isas
from compile_stack.backend.pass_backend import PassBackend
from torch_internals import inductor


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """Inductor's caches in ``tmp_path``, its ISA answers forgotten before and after; each build
    check Inductor's probe makes is listed (and passes for AVX2 only, a host of our making)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    seen = []
    monkeypatch.setattr(cpu_vec_isa.VecISA, "check_build", lambda isa, code: seen.append(str(isa)) or str(isa) == "avx2")
    inductor.forget_vec_isas()
    yield seen
    inductor.forget_vec_isas()  # later tests probe the real host


def found() -> list[str]:
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]


def restart() -> None:
    """What a new process on the same cache directory starts from."""
    inductor.forget_vec_isas()


def test_the_first_process_probes_and_records_and_a_later_one_reads_the_record(tmp_path, probes):
    vec_isas.recall()
    first = found()
    assert probes, "the first process probes"
    record = json.loads((tmp_path / vec_isas.RECORD).read_text())
    assert record == {"host": inductor.vec_isa_host(), "valid": first}
    restart()
    probes.clear()
    vec_isas.recall()
    assert probes == [] and found() == first
    assert first == (["avx2"] if "avx2" in cpu_vec_isa.x86_isa_checker() else []), "what the probe found, no more"


@pytest.mark.parametrize("changed", ["torch", "compiler", "compiler_version", "cpu"])
def test_a_record_from_another_torch_compiler_or_cpu_is_probed_again(tmp_path, probes, changed):
    vec_isas.recall()
    record = json.loads((tmp_path / vec_isas.RECORD).read_text())
    record["host"][changed] = "another"
    record["valid"] = ["avx512"]
    (tmp_path / vec_isas.RECORD).write_text(json.dumps(record))
    restart()
    probes.clear()
    vec_isas.recall()
    assert probes, f"a record made with another {changed} is not this host's answer"
    assert json.loads((tmp_path / vec_isas.RECORD).read_text())["host"] == inductor.vec_isa_host()


@pytest.mark.parametrize("damage", ["{not json", json.dumps({"host": "x"}), json.dumps([1, 2])])
def test_a_damaged_record_is_probed_again(tmp_path, probes, damage):
    (tmp_path / vec_isas.RECORD).write_text(damage)
    vec_isas.recall()
    assert probes
    assert json.loads((tmp_path / vec_isas.RECORD).read_text())["valid"] == found()


def test_an_answer_inductor_is_told_is_neither_probed_nor_recorded(tmp_path, probes):
    with inductor.config_patch({"cpp.vec_isa_ok": True}):
        vec_isas.recall()
    assert probes == [] and not (tmp_path / vec_isas.RECORD).exists()


def test_a_cpu_graph_compile_records_the_answer_and_a_graph_without_codegen_needs_none(tmp_path, probes):
    torch.compile(lambda t: t.sin() + 1, backend=PassBackend([], codegen=False))(torch.randn(3))
    assert probes == [] and not (tmp_path / vec_isas.RECORD).exists()
    torch.compile(lambda t: t.cos() + 1, backend=PassBackend([]))(torch.randn(3))
    assert json.loads((tmp_path / vec_isas.RECORD).read_text())["valid"] == found()

"""The memory options a user may give, checked by one rule for every entry point.

``compile_step``'s arguments, ``run_step.py``'s and the leaderboard harness's
flags, and the backend's budget setting all ask ``check_options``: a bad value
raises ``ValueError('<name>: expected ..., got ...')`` before any work.

- ``memory_budget``: AOTAutograd's activation memory budget, a fraction in
  [0, 1], or None (the plan chooses one per graph).
- ``offload_activations``: None (the default: the plan moves saved activations
  to host memory where that recomputes less, within the host's free memory
  less a reserve, ``host.py``), True (the same, said explicitly), False (off),
  or a float in (0, 1): that share of the host's physical memory instead.
  Offload extends the plan chosen per graph, so a fixed budget with offload
  asked for is refused; with a fixed budget the default is off.
"""
from custom_ops.checks import require

OFFLOAD_EXPECTED = "a share of the host's memory in (0, 1) (a float), or True, False or None"


def check_memory_budget(value, name: str = "memory_budget") -> None:
    """``value`` is None or a fraction in [0, 1]."""
    require(value is None or (isinstance(value, (int, float)) and not isinstance(value, bool)
                              and 0.0 <= value <= 1.0), name, "a fraction in [0, 1]", value)


def check_offload(value, name: str = "offload_activations") -> None:
    """``value`` is None, True, False or a float share in (0, 1)."""
    require(value is None or isinstance(value, bool) or (isinstance(value, float) and 0.0 < value < 1.0),
            name, OFFLOAD_EXPECTED, value)


def check_options(memory_budget, offload_activations, budget_name: str = "memory_budget",
                  offload_name: str = "offload_activations") -> None:
    """Both options, and that offload is not asked for with a fixed budget."""
    check_memory_budget(memory_budget, budget_name)
    check_offload(offload_activations, offload_name)
    require(offload_activations in (None, False) or memory_budget is None, offload_name,
            f"False with a fixed {budget_name} (offload extends the plan chosen per graph)", offload_activations)

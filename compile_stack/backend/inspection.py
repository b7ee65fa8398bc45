"""``--inspect DIR``: what every compiled graph looked like and what Inductor made of it.

For each graph Dynamo captured (``<name>``): the captured graph
(``<name>.dynamo.py``), the graph before and after our passes at each stage
(``<name>.<stage>[.k].before.txt`` / ``.after.txt``), and the Python/Triton
code Inductor generated (``<name>.code[.k].py``: forward, then backward).
``DIR/index.md`` lists the files and says which is which.
"""
import contextlib
from collections import Counter
from pathlib import Path

import torch

from torch_internals import inductor

_DESCRIPTIONS = {
    "dynamo": "graph captured by Dynamo (torch level), as compiled",
    "before": "graph before our passes",
    "after": "graph after our passes",
    "code": "code Inductor generated (Python wrapper + Triton/C++ kernels)",
}


class InspectionWriter:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.entries: list[tuple[str, str]] = []
        self._seen: Counter = Counter()
        self.graph_name = "graph"

    def _write(self, stem: str, suffix: str, text: str, what: str) -> None:
        self._seen[stem] += 1
        n = self._seen[stem]
        name = f"{stem}{'' if n == 1 else f'.{n}'}{suffix}"
        (self.dir / name).write_text(text)
        self.entries.append((name, what))
        self._write_index()

    def _write_index(self) -> None:
        lines = ["# Compiled graphs", "", "| file | what it is |", "|---|---|"]
        lines += [f"| `{name}` | {what} |" for name, what in self.entries]
        lines += ["", "A training graph's code comes in two files: the forward, then the backward."]
        (self.dir / "index.md").write_text("\n".join(lines) + "\n")

    def begin_graph(self, graph_name: str, gm: torch.fx.GraphModule) -> None:
        """Files written from now on belong to ``graph_name``; write its Dynamo graph."""
        self.graph_name = graph_name
        self._write(f"{graph_name}.dynamo", ".py", gm.print_readable(print_output=False), _DESCRIPTIONS["dynamo"])

    def observer(self):
        def observe(stage: str, graph: torch.fx.Graph, when: str) -> None:
            self._write(f"{self.graph_name}.{stage}.{when}", ".txt", str(graph), f"{stage}: {_DESCRIPTIONS[when]}")

        return observe

    def output_code(self, code: str) -> None:
        self._write(f"{self.graph_name}.code", ".py", code, _DESCRIPTIONS["code"])


@contextlib.contextmanager
def capture_output_code(writer: InspectionWriter | None):
    """While active, the code Inductor generates goes to ``writer``."""
    if writer is None:
        yield
        return
    with inductor.output_code_writer(writer.output_code):
        yield

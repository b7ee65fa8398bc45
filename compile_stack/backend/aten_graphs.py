"""Our stages without Inductor's code generation: the rewritten aten graphs run as they are.

``PassBackend(codegen=False)`` runs the same stages on the same graphs as a
real compile — our pre-grad passes (before this is called), AOTAutograd with
Inductor's decompositions, our joint passes before the partitioner, our
post-grad passes — but executes the resulting aten graphs instead of
generating code. Tests use it to check graph rewrites in seconds; it is also
a debugging aid.
"""
import functools

from torch_internals import aot, dynamo
from torch_internals.aot import min_cut_rematerialization_partition
from torch_internals.inductor import select_decomp_table


def compile_aten_graphs(gm, example_inputs, stage: dict, partitioner=None):
    """``gm`` through AOTAutograd with our ``stage`` passes (``registry.stage_passes``) at the joint
    and post-grad stages, partitioned by ``partitioner`` (default: the min-cut partitioner)."""

    def partition(joint, joint_inputs, **kwargs):
        stage["joint"](joint.graph)
        joint.recompile()
        return (partitioner or min_cut_rematerialization_partition)(joint, joint_inputs, **kwargs)

    def compile_graph(graph_module, inputs, is_inference=False):
        if is_inference:
            stage["joint"](graph_module.graph)
        stage["post_grad"](graph_module.graph)
        graph_module.recompile()
        return aot.make_boxed_func(graph_module.forward)

    return dynamo.aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        inference_compiler=functools.partial(compile_graph, is_inference=True),
        partition_fn=partition,
        decompositions=select_decomp_table(),
        keep_inference_input_mutations=True,
    )(gm, example_inputs)

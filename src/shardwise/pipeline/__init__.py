"""Pipeline parallelism: a model cut into stages, one stage per rank (or several: interleaved),
micro-batches flowing through them on a GPipe, 1F1B or interleaved 1F1B schedule, over c10d
point-to-point or over RPC.

Names follow ``torch.distributed.pipelining`` where they overlap: ``PipelineStage``,
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
``schedule.step(*inputs, target=, losses=)``. Layout: split.py (stages from a model), stage.py
(a stage's runtime and measurements), schedules.py, interleaved.py (several stages per rank),
p2p.py and rpc_transport.py (the two transports), activations.py (saved-activation bytes),
groups.py (pipeline x data-parallel groups). See docs/pipeline.md.
"""

from shardwise.pipeline.activations import ActivationMeter
from shardwise.pipeline.groups import PipelineLayout, layout_ranks, pipeline_layout
from shardwise.pipeline.interleaved import (
    ScheduleInterleaved1F1B,
    interleaved_order,
    simulate,
    simulated_bubble,
)
from shardwise.pipeline.schedules import (
    Schedule1F1B,
    ScheduleGPipe,
    gpipe_order,
    max_in_flight,
    one_f_one_b_order,
)
from shardwise.pipeline.split import (
    Embed,
    Head,
    Stage,
    balanced_cuts,
    gpt_layers,
    layers_of,
    parameter_costs,
    sequential_layers,
    split_by_names,
    split_gpt,
    split_layers,
    time_costs,
)
from shardwise.pipeline.stage import PipelineStage, StepStats, bubble_fraction

__all__ = [
    "ActivationMeter",
    "Embed",
    "Head",
    "PipelineLayout",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "Stage",
    "StepStats",
    "balanced_cuts",
    "bubble_fraction",
    "gpipe_order",
    "gpt_layers",
    "interleaved_order",
    "layers_of",
    "layout_ranks",
    "max_in_flight",
    "one_f_one_b_order",
    "parameter_costs",
    "pipeline_layout",
    "sequential_layers",
    "simulate",
    "simulated_bubble",
    "split_by_names",
    "split_gpt",
    "split_layers",
    "time_costs",
]

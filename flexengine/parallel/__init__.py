"""Tensor parallelism: the process group, sharded layers, checkpoint slices, spawned workers (docs/parallelism.md).

What the engine uses: start_tensor_parallel (checks, spawns, joins), building_for (layers built for a
group), shift_layer_mods (mods see global heads), agree_on_min (one KV block count), drive_workers (rank 0
announces each step). init_tensor_parallel / tp_rank / tp_size / tp_group: this process's group.
"""
from .driver import drive_workers
from .heads import shift_layer_mods
from .launch import agree_on_min, start_tensor_parallel
from .state import building_for, init_tensor_parallel, tp_group, tp_rank, tp_size

__all__ = ["agree_on_min", "building_for", "drive_workers", "init_tensor_parallel", "shift_layer_mods",
           "start_tensor_parallel", "tp_group", "tp_rank", "tp_size"]

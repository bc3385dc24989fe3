"""HSPMD annotations (docs/design.md §2): device groups, distributed states, DS/DG unions, layouts.

``states`` holds the algebra (device ids only, never ranks); ``from_plan`` expands a plan strategy
into the annotations of every parameter, gradient, input batch and stage-boundary activation.
"""

from runtime.torchfree.annotations.states import (
    DUPLICATE,
    PARTIAL,
    Annotation,
    DeviceGroup,
    DGUnion,
    DistributedStates,
    DSUnion,
    Holding,
    Layout,
    LayoutError,
    Region,
    lcm_degrees,
    region_index,
)

__all__ = [
    "DUPLICATE", "PARTIAL", "Annotation", "DeviceGroup", "DGUnion", "DistributedStates", "DSUnion", "Holding",
    "Layout", "LayoutError", "Region", "lcm_degrees", "region_index",
]

"""The formats the profiler, planner and runtime exchange: cluster, model and plan specs."""

from runtime.torchfree.spec.catalog import (
                                  CONFIGS_DIR,
                                  PlanContext,
                                  catalog_names,
                                  dump_plan,
                                  load_cluster,
                                  load_model,
                                  load_plan,
                                  load_plan_context,
                                  save_plan,
)
from runtime.torchfree.spec.cluster import BandwidthOverride, Cluster, Device, DeviceType, Emulation, Node
from runtime.torchfree.spec.model import ModelSpec
from runtime.torchfree.spec.plan import (
                                  PLAN_VERSION,
                                  OptimizerSettings,
                                  Pipeline,
                                  Plan,
                                  Stage,
                                  Strategy,
                                  TrainingSettings,
)
from runtime.torchfree.spec.validate import validate_plan

__all__ = [
    "CONFIGS_DIR", "PlanContext", "catalog_names", "dump_plan", "load_cluster", "load_model",
    "load_plan", "load_plan_context", "save_plan", "BandwidthOverride", "Cluster", "Device",
    "DeviceType", "Emulation", "Node", "ModelSpec", "PLAN_VERSION", "OptimizerSettings", "Pipeline",
    "Plan", "Stage", "Strategy", "TrainingSettings", "validate_plan",
]

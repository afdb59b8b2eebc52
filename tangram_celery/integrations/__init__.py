"""Adapters for RL frameworks: verl (custom reward function, multi-turn code tool), OpenRLHF and
slime (remote reward endpoints served by `tangram serve`). No framework is imported when these
modules load: verl's classes are imported only when the tool class is first used."""

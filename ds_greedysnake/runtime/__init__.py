"""The step: the engine (a DeepSpeed engine subclass), the schedule and its executor, the layers, activations,
RNG, data parallel, LayerwiseAdam. Imports optim/, models/, storage/, the base; never the planner or hf/."""

"""Segment checkpointing: keep only a segment's inputs during forward, recompute it in backward.

The autograd node is torch_ext's C++ core (csrc/torch_ext/checkpoint): its forward runs the
segment without building a graph and stores only the boundary inputs; its backward restores the
RNG, autocast and grad-mode state of the forward, replays the segment and back-propagates
through the replay. Parameters are explicit inputs of the node, so torch.autograd.grad,
backward(inputs=...), hooks and DistributedDataParallel behave as without checkpointing.
On CPU, the replays of Python segments stop early: the ops after the last one whose output
backward saves are not computed (see _ReplayTail).

    torch_ext.checkpoint            decorator for nn.Module subclasses, instances and functions
    torch_ext.CheckpointedSequential a chain with checkpointed boundaries and memory accounting
    torch_ext.checkpoint_sequential drop-in for torch.utils.checkpoint.checkpoint_sequential
    torch_ext.plan_checkpoints      measured, budgeted boundary placement (dynamic programming)

Storage policies for the boundary: "keep" (default, exact), "offload" (accelerator inputs go to
pinned CPU memory asynchronously; CPU inputs are kept), "bf16" / "fp16" (lossy and opt-in: float
inputs are stored rounded, so gradients are approximate).

Under torch.compile a checkpointed call is a graph break: the compiled code runs up to it, the
checkpoint runs eagerly, and compilation resumes after it.
"""
from .api import checkpoint
from .chains import CheckpointedSequential, checkpoint_sequential
from .planner import CheckpointPlan, plan_checkpoints

__all__ = ["checkpoint", "CheckpointedSequential", "checkpoint_sequential", "plan_checkpoints", "CheckpointPlan"]

"""Segment checkpointing: keep only a segment's inputs during forward, recompute it in backward.

    torch_ext.checkpoint             decorator for nn.Module subclasses, instances and functions
    torch_ext.checkpoint_call        drop-in for torch.utils.checkpoint.checkpoint(fn, *args, ...)
    torch_ext.CheckpointedSequential a chain with checkpointed boundaries and memory accounting
    torch_ext.checkpoint_sequential  drop-in for torch.utils.checkpoint.checkpoint_sequential
    torch_ext.plan_checkpoints       measured, budgeted boundary placement (dynamic programming)
    torch_ext.plan_ops               measured, budgeted op-level plan: which ops each checkpointed block saves
    torch_ext.checkpointing.hf       Hugging Face models: their gradient checkpointing with
                                     torch_ext's function, per-layer checkpointing by every=k or a budget

Segments are checkpointed with saved-tensor hooks in C++ (csrc/torch_ext/checkpoint/frame.h),
one engine for every front door (Python, TorchScript's checkpoint_module, the C++ API): the
forward builds the ordinary autograd graph with placeholders instead of the tensors it would save;
the first unpack in a backward pass replays the segment once, checks every tensor the replay saves
against the forward's (shape, dtype, device: a mismatch raises CheckpointError naming the segment
and the tensor), and stops once they are all recomputed where the recorded graph's tail is worth
skipping. Gradients, double backward, nested checkpoints, hooks and closures behave as without
checkpointing.

Every entry point takes torch's context_fn: with torch.utils.checkpoint's
create_selective_checkpoint_contexts, selective checkpointing with torch's semantics (the forward
runs under the first context, each replay under the second).

Storage policies for the inputs: "keep" (default, exact: the replay gets the caller's tensors),
"offload" (accelerator inputs go to pinned CPU memory asynchronously; CPU inputs are kept),
"bf16" / "fp16" (lossy and opt-in: float inputs are stored rounded, so gradients are approximate).

Under torch.compile a checkpointed call is traced, through torch.utils.checkpoint (a higher-order
op), as torch's own checkpoint is; storage policies other than "keep" do not apply there.
"""
from . import hf
from .api import CheckpointError, checkpoint, checkpoint_call
from .chains import CheckpointedSequential, checkpoint_sequential
from .op_planner import OpPlan, plan_ops
from .planner import CheckpointPlan, plan_checkpoints

__all__ = ["checkpoint", "checkpoint_call", "CheckpointError", "CheckpointedSequential", "checkpoint_sequential",
           "plan_checkpoints", "CheckpointPlan", "plan_ops", "OpPlan", "hf"]

"""DeepSpeed's universal checkpoint, read per parameter: what ``ds_to_universal`` writes from ZeRO's flat partitions.

``<step>_universal/zero/<param>/`` holds one directory a parameter: ``fp32.pt`` (its fp32 master weight), and for
a parameter the optimizer steps ``exp_avg.pt``, ``exp_avg_sq.pt`` (each ``torch.save({"cat_dim": 0, "param":
tensor})``) and ``step.pt`` (a bare 0-dim tensor); a frozen parameter has ``fp32.pt`` alone (and is listed in
``frozen_param_shapes`` of ``mp_rank_00_model_states.pt`` beside ``zero/``). ``zero/optimizer_state.pt`` holds
the param groups, pickled with DeepSpeed's classes, so it is not read. Each parameter's files are one state entry;
a parameter that is neither frozen nor has optimizer state is missing, which DeepSpeed's universal loader
(``load_checkpoint`` with ``load_universal``) cannot resume: it reads every state file of every parameter it steps.
"""

from optim_repair.formats.deepspeed_universal.reader import member_of, read_universal, universal_roots

__all__ = ["member_of", "read_universal", "universal_roots"]

def job():
    import torch
    from torch.profiler import profile, ProfilerActivity
    import qn_hf
    from transformers import AutoModelForCausalLM
    from tests.planner_memory_cases import config_for
    torch.manual_seed(0)
    pm = qn_hf.parallelize(AutoModelForCausalLM.from_config(config_for("llama")), dp=2, dp_shard=2)
    ids = torch.randint(3, 100, (2, 64))
    pm.train_step({"input_ids": ids, "labels": ids})
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        pm.train_step({"input_ids": ids, "labels": ids})
    ev = [(e.name, e.time_range.start, e.time_range.end, e.thread) for e in prof.events()
          if e.name.startswith(("FSDP", "gloo", "c10d", "record_param")) ]
    ev.sort(key=lambda x: x[1])
    return ev[:80]

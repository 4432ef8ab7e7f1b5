import time, warnings; warnings.filterwarnings("ignore"); t0=time.time()
import torch, transformers
transformers.logging.set_verbosity_error()
small=dict(num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2,num_key_value_heads=1,vocab_size=64)
cases={"gpt2":(transformers.GPT2LMHeadModel,transformers.GPT2Config(n_layer=1,n_embd=16,n_head=2,vocab_size=64)),
 "llama":(transformers.LlamaForCausalLM,transformers.LlamaConfig(**small)),
 "qwen3":(transformers.Qwen3ForCausalLM,transformers.Qwen3Config(**small)),
 "mixtral":(transformers.MixtralForCausalLM,transformers.MixtralConfig(**small,num_local_experts=2)),
 "vit":(transformers.ViTForImageClassification,transformers.ViTConfig(num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2)),
 "bert":(transformers.BertForMaskedLM,transformers.BertConfig(num_hidden_layers=1,hidden_size=16,intermediate_size=32,num_attention_heads=2)),
}
for k,(cls,cfg) in cases.items():
    with torch.device("meta"): m=cls(cfg)
    params={n for n,_ in m.named_parameters(remove_duplicate=False)}
    sd=set(m.state_dict())
    print(k, "persistent buffers:", sorted(sd-params)[:4], "tied:", sorted(params - {n for n,_ in m.named_parameters()}))
print(time.time()-t0)

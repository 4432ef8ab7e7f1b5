"""PEFT models under the mesh: ``lora.py`` says which LoRA models are accepted and shards each LoRA
layer under its base layer's tensor-parallel style."""

"""Multi-LoRA serving: PEFT adapters over one base model, batched together (issue 15)."""

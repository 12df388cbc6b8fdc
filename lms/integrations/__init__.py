"""Framework integrations, one module each; each imports its framework itself.

- `lms.integrations.lightning.LMSCallback`: a Lightning ``Trainer`` callback.
- `lms.integrations.transformers.offload_trainer`: wraps a Hugging Face ``Trainer``'s steps.
"""

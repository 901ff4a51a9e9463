"""Reading a model where it lies: a GGUF file (memory-mapped, quantised blocks untouched) or a Hugging Face folder
(safetensors, read lazily). Both give a config, a tokenizer and a table of StoredTensor keyed by the Hugging Face
parameter names our model code and the native packing share. Nothing here builds a model or imports one."""

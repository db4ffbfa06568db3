def concretize_chunk_symbols(gm, example_inputs=None): raise NotImplementedError

import os
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"]="0"; os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"]="0"
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from ap_backend import measure_saved, precompile
from ap_testing.distributed import fake_world
from zoo.fsdp import FsdpTrainStep
from zoo.models import torchtitan_models
with fake_world(128):
    with torch.device("meta"):
        zm = torchtitan_models.llama3_8b(0, n_layers=1, seq=256, vocab=256)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        m = zm.module
        for name, p in list(m.named_parameters()):
            mod, _, attr = name.rpartition(".")
            setattr(m.get_submodule(mod), attr, nn.Parameter(torch.empty(p.shape, dtype=torch.bfloat16), p.requires_grad))
        for name, b in list(m.named_buffers()):
            mod, _, attr = name.rpartition(".")
            m.get_submodule(mod).register_buffer(attr, torch.empty(b.shape, dtype=b.dtype))
        step = FsdpTrainStep(zm.module, zm.loss_fn, n_model_inputs=1)
        batch = (torch.zeros(1, 256, dtype=torch.long), torch.zeros(1, 256, dtype=torch.long))
    print(type(next(step.parameters())), next(step.parameters()).device)
    s = measure_saved(step, batch, partitioner="min_cut", enable_ac=False)
    print("plain", s.count, s.nbytes, len(s.all_gather_outputs))
    pm = precompile(step, batch)
    print("first", pm.first_partition.count, pm.first_partition.nbytes)
    s = measure_saved(pm, batch, partitioner="save_all", enable_ac=False)
    print("replay", s.count, s.nbytes)

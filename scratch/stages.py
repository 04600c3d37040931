import logging, time, tempfile, sys, torch, aoti_eager
import transformers
transformers.logging.set_verbosity_error()
h = logging.StreamHandler(sys.stdout); h.setLevel(logging.DEBUG)
lg = logging.getLogger("aoti_eager"); lg.setLevel(logging.DEBUG); lg.addHandler(h)
class F(logging.Filter):
    def filter(self, r): return "stage" in r.getMessage() or "compiled" in r.getMessage()
h.addFilter(F())
cfg = transformers.GPT2Config(n_layer=2, n_embd=768, n_head=12)
m = transformers.GPT2LMHeadModel(cfg).cuda().train()
ids = torch.randint(0, 50257, (8, 256), device="cuda")
aoti_eager.fuse(m, cache_dir=tempfile.mkdtemp())
t = time.time(); m(input_ids=ids, labels=ids, use_cache=False).loss.backward(); torch.cuda.synchronize(); print("first step", time.time() - t)

import dataclasses, sys, torch
from pdserve.model.loader import load_model
from pdserve.engine.pages import PageAllocator
from pdserve.engine.request import Policy, Request, RequestState
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.drafter import OracleDrafter
from pdserve import kernels
torch.manual_seed(0)
model = load_model(sys.argv[1], "cuda", torch.bfloat16, progress=False, load_format="dummy")
prompt = torch.randint(3, model.args.vocab_size, (200,)).tolist()
def gen(k, force_mtp=False, oracle=None, graphs=False, tokens=16):
    runner = ModelRunner(model, 64, 40, cuda_graphs=graphs)
    if oracle is not None:
        runner.drafter = OracleDrafter(model, runner.cache, {"a": prompt + oracle}, 1.0)
    s = Scheduler(PageAllocator(runner.num_pages), 64, 8192, 8192, model.args.vocab_size, 100000, [], num_drafts=k)
    r = Request("a", list(prompt), SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0), Policy.AGGREGATED)
    s.add(r)
    while r.state not in (RequestState.FINISHED, RequestState.ABORTED):
        plan, _ = s.schedule()
        if force_mtp: plan = dataclasses.replace(plan, mtp=True)
        res = runner.execute(plan)
        assert not res.decode_error and not res.prefill_error, (res.decode_error, res.prefill_error)
        s.finish_step(plan, [res])
    return r.token_ids[len(prompt):], r.num_drafted, r.num_accepted
for bi in (False, True):
    with kernels.use_batch_invariant(bi):
        base = gen(0)[0]
        print("bi", bi, "base", base)
        print(" mtp passes only:", gen(0, force_mtp=True)[0] == base)
        for k in (1, 2):
            out, d, a = gen(k, oracle=base)
            print(f" K={k} oracle p=1: same={out == base} drafted={d} accepted={a}", out)
        out, d, a = gen(2, oracle=base, graphs=True)
        print(f" K=2 graphs: same={out == base} drafted={d} accepted={a}")

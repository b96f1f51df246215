import tempfile

from tiny import data, spec

checkpoints = tempfile.mkdtemp()
# --8<-- [start:resume]
from cerebro_automl import Session

def search(resume: bool):
    with Session(spec, data, seed=0, checkpoint_dir=checkpoints, resume=resume, executor="local") as s:
        for lr in (1e-3, 3e-3):                     # the same configs in the same order: the same names
            s.add({"lr": lr, "width": 32}, epochs=3)
        s.run()
        return s.history

search(resume=False)                                # a run that the driver's death would interrupt
again = search(resume=True)                         # continues each model after its newest checkpoint
# --8<-- [end:resume]
print(again)

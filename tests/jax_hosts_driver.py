"""One process of a JAX run over several processes (tests/test_jax_hosts.py starts two on the loopback
address, 2 host devices each): joins the others from the environment, trains the test card on the
default mesh with its own rows, and the first process writes the losses and the held-out loss to OUT (where
training fails, each process writes its error to OUT.error-INDEX)."""

import importlib
import json
import sys

from linnet.jax import hosts

hosts.join()  # before anything touches a device

from test_jax_train import adamw, load, rows  # noqa: E402  (after joining)
import jax  # noqa: E402

jax_train = importlib.import_module("linnet.jax.train")  # the module: linnet.jax.train is also the function

card, steps, checkpoint, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
run_rows = int(sys.argv[5]) if len(sys.argv) > 5 else 4 * 4  # the whole run's, dealt to the processes
checkpoint = checkpoint.format(process=jax.process_index())  # a folder of each process's own, where asked
mesh = jax_train.default_mesh()
model = load(card)
try:
    _, history = jax_train.train(model, jax_train.own_rows(rows(run_rows), mesh, 1), optimizer=adamw(), steps=steps,
                                 mesh=mesh, on_step=lambda step: None, checkpoint=checkpoint)
except Exception as error:  # what each process was told, for the test to read
    with open(f"{out}.error-{jax.process_index()}", "w") as f:
        f.write(f"{type(error).__name__}: {error}")
    raise SystemExit(3) from error
held_out = jax_train.evaluate(model, rows(4, seed=11))
model.save_weights(f"{checkpoint}-weights")

if jax.process_index() == 0:
    with open(out, "w") as f:
        json.dump({"losses": [s.loss for s in history.steps], "loss_tokens": [s.loss_tokens for s in history.steps],
                   "held_out": held_out, "mesh": dict(mesh.shape)}, f)

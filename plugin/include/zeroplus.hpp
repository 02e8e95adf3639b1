// zeroplus.hpp: the one header a LibTorch program includes (../docs/cpp.md).
//
//   #include "zeroplus.hpp"
//   auto pg = zeroplus::pg::makeProcessGroup(store, rank, world);     // the "zeroplus" backend
//   auto opt = zeroplus::zero::initialize(model, pg, zeroplus::zero::Options().stage(2),
//                                         zeroplus::optim::ZeroAdamWOptions(1e-3).weight_decay(0.01));
//   opt->zero_grad(); opt->backward(loss); opt->clip_grad_norm(1.0); opt->step();
//   auto full = zeroplus::zero::full_state_dict(model, *opt);
//   zeroplus::save_checkpoint("ckpt/step100", model, *opt);        // Python's format
//   zeroplus::load_checkpoint("ckpt/step100", model, *opt);
//
// It gives the process group (process_group/adapter/process_group.hpp), the ZeRO engine's
// LibTorch front-end (optimizers/adapter/zero/zero_optimizer.hpp), the ZeRO-1 optimizer
// ZeroAdamW and its options, and the io_uring layer (aio/adapter/aio_handle.hpp). Each of those
// headers' opening comment is its contract.
#pragma once

#include "aio/adapter/aio_handle.hpp"
#include "optimizers/adapter/zero/checkpoint_io.hpp"
#include "optimizers/adapter/zero/zero_optimizer.hpp"
#include "optimizers/adapter/zero_adamw.hpp"
#include "process_group/adapter/process_group.hpp"

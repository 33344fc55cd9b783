#include <gtest/gtest.h>

#include <atomic>

#include <ATen/Context.h>
#include <ATen/ops/randn.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

#include "torch_ext/checkpoint/checkpoint.h"
#include "torch_ext/checkpoint/frame.h"
#include "torch_ext/checkpoint/module.h"

namespace ck = torch_ext::checkpoint;
using torch::autograd::variable_list;

namespace {

// A segment with dropout: tanh(x @ w^T) with p=0.5 dropout, counting its calls.
struct DropoutSegment {
  at::Tensor weight;
  std::shared_ptr<std::atomic<int>> calls = std::make_shared<std::atomic<int>>(0);
  ck::TensorList operator()(const ck::TensorList& in) const {
    calls->fetch_add(1);
    auto y = torch::tanh(torch::matmul(in[0], weight.t()));
    return {torch::dropout(y, 0.5, /*train=*/true), y.sum()};
  }
};

bool same(const variable_list& a, const variable_list& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined() || (a[i].defined() && !a[i].equal(b[i]))) return false;
  }
  return true;
}

}  // namespace

TEST(Checkpoint, GradientsEqualThePlainSegmentExactlyWithDropout) {
  torch::manual_seed(0);
  auto weight = at::randn({8, 8}).requires_grad_();
  auto x = at::randn({4, 8}).requires_grad_();
  DropoutSegment segment{weight};

  torch::manual_seed(7);
  auto plain = segment({x});
  auto plain_loss = plain[0].pow(2).sum() + plain[1];
  auto plain_grads = torch::autograd::grad({plain_loss}, {x, weight});

  torch::manual_seed(7);
  const int before = segment.calls->load();
  auto out = ck::checkpoint(segment, {x});
  EXPECT_EQ(segment.calls->load(), before + 1);
  auto loss = out[0].pow(2).sum() + out[1];
  EXPECT_TRUE(loss.equal(plain_loss));
  auto grads = torch::autograd::grad({loss}, {x, weight});
  EXPECT_EQ(segment.calls->load(), before + 2);
  EXPECT_TRUE(same(grads, plain_grads));
  EXPECT_FALSE(weight.grad().defined());  // gradients went through the graph, not into .grad
}

TEST(Checkpoint, RngStreamContinuesAsWithoutCheckpointing) {
  auto x = at::randn({16}).requires_grad_();
  auto segment = [](const ck::TensorList& in) -> ck::TensorList { return {torch::dropout(in[0], 0.5, true)}; };
  torch::manual_seed(3);
  ck::checkpoint(segment, {x})[0].sum().backward();
  auto after_checkpoint = at::randn({4});
  torch::manual_seed(3);
  segment({x})[0].sum().backward();
  EXPECT_TRUE(at::randn({4}).equal(after_checkpoint));
}

TEST(Checkpoint, NoGradRunsPlainly) {
  auto x = at::randn({4}).requires_grad_();
  int calls = 0;
  auto segment = [&calls](const ck::TensorList& in) -> ck::TensorList {
    ++calls;
    return {in[0] * 2};
  };
  torch::autograd::AutoGradMode no_grad(false);
  auto out = ck::checkpoint(segment, {x});
  EXPECT_FALSE(out[0].requires_grad());
  EXPECT_EQ(calls, 1);
}

TEST(Checkpoint, NestedCheckpointsGiveExactGradients) {
  torch::manual_seed(0);
  auto w = at::randn({6, 6}).requires_grad_();
  auto x = at::randn({3, 6}).requires_grad_();
  auto inner = [w](const ck::TensorList& in) -> ck::TensorList { return {torch::sin(torch::matmul(in[0], w))}; };
  auto outer = [&](const ck::TensorList& in) -> ck::TensorList {
    return {ck::checkpoint(inner, {in[0] * 3})[0].exp()};
  };
  auto plain = torch::autograd::grad({outer({x})[0].sum()}, {x, w});
  auto grads = torch::autograd::grad({ck::checkpoint(outer, {x})[0].sum()}, {x, w});
  EXPECT_TRUE(same(grads, plain));
}

TEST(Checkpoint, TorchNnModuleAndSequentialFrontDoors) {
  torch::manual_seed(0);
  torch::nn::Linear linear(8, 8);
  auto x = at::randn({2, 8}).requires_grad_();
  auto plain = torch::autograd::grad({linear->forward(x).sum()}, {x, linear->weight, linear->bias});
  auto grads =
      torch::autograd::grad({ck::checkpoint_module(linear, x).sum()}, {x, linear->weight, linear->bias});
  EXPECT_TRUE(same(grads, plain));

  torch::nn::Sequential seq(torch::nn::Linear(8, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8), torch::nn::Tanh());
  auto params = seq->parameters();
  variable_list targets{x};
  targets.insert(targets.end(), params.begin(), params.end());
  auto seq_plain = torch::autograd::grad({seq->forward(x).sum()}, targets);
  auto seq_grads = torch::autograd::grad({ck::checkpoint_sequential(seq, 2, x).sum()}, targets);
  EXPECT_TRUE(same(seq_grads, seq_plain));
  EXPECT_THROW(ck::checkpoint_sequential(seq, 9, x), c10::Error);
}

TEST(Checkpoint, CompressedStorageIsApproximateAndSmaller) {
  torch::manual_seed(0);
  auto x = at::randn({64, 64}).requires_grad_();
  auto segment = [](const ck::TensorList& in) -> ck::TensorList { return {in[0].pow(3)}; };
  ck::CheckpointOptions options;
  options.storage = ck::StoragePolicy::kBFloat16;
  EXPECT_EQ(ck::boundary_bytes({x}, options.storage).expect_int(), 64 * 64 * 2);
  EXPECT_EQ(ck::boundary_bytes({x}, ck::StoragePolicy::kKeep).expect_int(), 64 * 64 * 4);
  // Not x itself: a leaf requiring grad lives until backward anyway, so the frame keeps it exactly.
  auto grad = torch::autograd::grad({ck::checkpoint(segment, {x * 1}, options)[0].sum()}, {x})[0];
  auto exact = 3 * x.detach().pow(2);
  EXPECT_FALSE(grad.equal(exact));
  EXPECT_LT((grad - exact).norm().item<double>() / exact.norm().item<double>(), 2e-2);
}

TEST(Checkpoint, StoreCopyIsTheOnePlaceAStoragePolicyApplies) {
  auto x = at::randn({8}).requires_grad_();
  EXPECT_FALSE(ck::store_copy(x, ck::StoragePolicy::kKeep).has_value());
  EXPECT_FALSE(ck::store_copy(x, ck::StoragePolicy::kOffload).has_value());  // a CPU tensor is kept
  EXPECT_FALSE(ck::store_copy(at::arange(8), ck::StoragePolicy::kBFloat16).has_value());  // not float
  auto stored = ck::store_copy(x, ck::StoragePolicy::kBFloat16);
  ASSERT_TRUE(stored.has_value());
  EXPECT_EQ(stored->copy.scalar_type(), at::kBFloat16);
  {
    at::NoGradGuard no_grad;
    x.mul_(2);  // the copy is a snapshot of the forward's value
  }
  at::Tensor restored = stored->restore();
  EXPECT_EQ(restored.scalar_type(), at::kFloat);
  EXPECT_TRUE(restored.requires_grad());
  EXPECT_TRUE(restored.is_leaf());
  EXPECT_TRUE(restored.equal((x.detach() / 2).to(at::kBFloat16).to(at::kFloat)));
}

TEST(Checkpoint, StoragePolicyNames) {
  EXPECT_EQ(torch_ext::enum_from_name<ck::StoragePolicy>("fp16"), ck::StoragePolicy::kFloat16);
  EXPECT_EQ(torch_ext::enum_name(ck::StoragePolicy::kOffload), "offload");
  try {
    torch_ext::enum_from_name<ck::StoragePolicy>("zip");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("unknown storage policy 'zip'"), std::string::npos);
  }
}

TEST(Checkpoint, ErrorsNameTheSegmentAndTheProblem) {
  auto x = at::randn({4}).requires_grad_();
  ck::CheckpointOptions options;
  options.name = "my_block";
  auto expect_error = [](const std::function<void()>& fn, const std::string& text) {
    try {
      fn();
      FAIL() << "expected an error containing: " << text;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  auto calls = std::make_shared<int>(0);
  auto changing = [calls](const ck::TensorList& in) -> ck::TensorList { return {in[0].narrow(0, 0, ++*calls).exp()}; };
  auto out = ck::checkpoint(changing, {x}, options);
  expect_error([&] { out[0].sum().backward(); },
               "the replay of my_block produced saved tensor 0 (made by ExpBackward0, Float[2] on cpu) where its "
               "forward produced saved tensor 0 (made by ExpBackward0, Float[1] on cpu)");

  auto writing = [](const ck::TensorList& in) -> ck::TensorList {
    auto y = in[0].exp();
    at::NoGradGuard no_grad;
    in[0].add_(1);
    return {y};
  };
  expect_error([&] { ck::checkpoint(writing, {x.detach().clone().requires_grad_()}, options); },
               "my_block wrote its input 0 in place during its forward");
  expect_error([&] { ck::checkpoint(ck::Segment(), {x}); }, "empty callable");
}

// What the frame gives the C++ front door as it gives Python's: a captured tensor's gradient, double
// backward, and an early stop that skips the segment's tail.
TEST(Checkpoint, CapturedTensorsGetTheirGradientsAndDoubleBackwardWorks) {
  torch::manual_seed(0);
  auto x = at::randn({4, 6}, at::kDouble).requires_grad_();
  auto w = at::randn({6, 6}, at::kDouble).requires_grad_();
  auto segment = [w](const ck::TensorList& in) -> ck::TensorList { return {torch::tanh(torch::mm(in[0], w))}; };
  auto plain = torch::autograd::grad({segment({x})[0].pow(2).sum()}, {x, w}, {}, std::nullopt, /*create_graph=*/true);
  auto grads = torch::autograd::grad({ck::checkpoint(segment, {x})[0].pow(2).sum()}, {x, w}, {}, std::nullopt, true);
  EXPECT_TRUE(same(grads, plain));
  EXPECT_TRUE(same(torch::autograd::grad({grads[0].sum()}, {x, w}), torch::autograd::grad({plain[0].sum()}, {x, w})));
}

TEST(Checkpoint, AReplayStopsEarlyBeforeAProductTail) {
  torch::manual_seed(0);
  auto x = at::randn({64, 64}).requires_grad_();
  auto w = at::randn({64, 64}).requires_grad_();
  for (const bool early_stop : {true, false}) {
    auto tails = std::make_shared<int>(0);
    auto segment = [w, tails](const ck::TensorList& in) -> ck::TensorList {
      // mm saves h and w, the last tensors the backward needs: the product after them is worth skipping
      auto y = torch::mm(torch::tanh(in[0]), w);
      ++*tails;  // a replay that stops early never gets here
      return {y.sum(1)};
    };
    ck::CheckpointOptions options;
    options.early_stop = early_stop;
    auto plain = torch::autograd::grad({segment({x})[0].sum()}, {x, w});
    *tails = 0;
    auto grads = torch::autograd::grad({ck::checkpoint(segment, {x}, options)[0].sum()}, {x, w});
    EXPECT_TRUE(same(grads, plain));
    EXPECT_EQ(*tails, early_stop ? 1 : 2) << early_stop;
  }
}

TEST(Checkpoint, ASegmentNeedingOnlyItsInputAndParametersIsNotReplayed) {
  torch::manual_seed(0);
  torch::nn::Linear linear(32, 16);
  auto calls = std::make_shared<int>(0);
  auto segment = [linear, calls](const ck::TensorList& in) mutable -> ck::TensorList {
    ++*calls;
    return {linear->forward(in[0])};
  };
  auto x = at::randn({8, 32}).requires_grad_();
  const auto params = linear->parameters();
  variable_list wrt{x, params[0], params[1]};
  auto plain = torch::autograd::grad({segment({x})[0].sum()}, wrt);
  *calls = 0;
  auto grads = torch::autograd::grad({ck::checkpoint(segment, {x})[0].sum()}, wrt);
  EXPECT_TRUE(same(grads, plain));
  EXPECT_EQ(*calls, 1);  // the addmm saved x and the weight, kept as autograd keeps them

  auto out = ck::checkpoint(segment, {x})[0].sum();
  {
    at::NoGradGuard no_grad;
    linear->weight.add_(1);
  }
  try {
    torch::autograd::grad({out}, wrt);
    FAIL() << "expected a CheckpointError";
  } catch (const ck::CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("modified by an inplace operation after the forward"), std::string::npos)
        << e.what();
  }
}

TEST(Checkpoint, OffloadedCudaBoundariesGiveExactGradients) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a CUDA device";
  torch::manual_seed(0);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  auto weight = at::randn({256, 256}, cuda).requires_grad_();
  auto x = at::randn({512, 256}, cuda).requires_grad_();
  auto segment = [&](const ck::TensorList& in) -> ck::TensorList {
    return {torch::gelu(torch::matmul(in[0], weight.t()))};
  };
  auto plain = torch::autograd::grad({segment({x})[0].pow(2).sum()}, {x, weight});
  ck::CheckpointOptions options;
  options.storage = ck::StoragePolicy::kOffload;
  auto out = ck::checkpoint(segment, {x}, options);
  auto grads = torch::autograd::grad({out[0].pow(2).sum()}, {x, weight});
  EXPECT_TRUE(same(grads, plain));
}

// ---- Frame: the core of Python checkpointing (saved-tensor hooks), driven here by hand ------

namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Frame, RecomputesOncePerBackwardPassAndHandsEachHolderItsTensor) {
  auto frame = std::make_shared<ck::Frame>("Seg", /*early_stop=*/false);
  auto first = frame->pack(at::zeros({2, 3}));
  auto second = frame->pack(at::zeros({4}));
  frame->finish_forward({});
  int replays = 0;
  frame->set_recompute([&](ck::Frame& f, int64_t task) {
    ++replays;
    f.repack(at::ones({2, 3}), task);
    f.repack(at::full({4}, 2.0), task);
  });
  EXPECT_TRUE(frame->unpack(*first).equal(at::ones({2, 3})));  // outside a backward: a fresh task
  EXPECT_EQ(replays, 1);
  // Each unpack outside a backward pass is its own pass: the second holder's pass replays again.
  EXPECT_TRUE(frame->unpack(*second).equal(at::full({4}, 2.0)));
  EXPECT_EQ(replays, 2);
}

TEST(Frame, AReplayOfAnotherShapeRaisesNamingTheSegmentAndTheTensor) {
  auto frame = std::make_shared<ck::Frame>("Seg", false);
  auto holder = frame->pack(at::zeros({2, 3}));
  frame->pack(at::zeros({5}));
  frame->finish_forward({});
  frame->set_recompute([](ck::Frame& f, int64_t task) {
    f.repack(at::zeros({2, 3}), task);
    f.repack(at::zeros({6}, at::kDouble), task);
  });
  const std::string error = error_of([&] { frame->unpack(*holder); });
  EXPECT_NE(error.find("the replay of Seg produced saved tensor 1 (Double[6] on cpu) where its forward produced "
                       "saved tensor 1 (Float[5] on cpu)"), std::string::npos) << error;
}

TEST(Frame, AReplayThatSavesFewerOrMoreTensorsRaises) {
  auto fewer = std::make_shared<ck::Frame>("Seg", false);
  auto holder = fewer->pack(at::zeros({2}));
  fewer->pack(at::zeros({2}));
  fewer->finish_forward({});
  fewer->set_recompute([](ck::Frame& f, int64_t task) { f.repack(at::zeros({2}), task); });
  EXPECT_NE(error_of([&] { fewer->unpack(*holder); }).find("saved 1 tensors for backward but its forward saved 2"),
            std::string::npos);

  auto more = std::make_shared<ck::Frame>("Seg", false);
  holder = more->pack(at::zeros({2}));
  more->finish_forward({});
  more->set_recompute([](ck::Frame& f, int64_t task) {
    f.repack(at::zeros({2}), task);
    f.repack(at::zeros({2}), task);
  });
  EXPECT_NE(error_of([&] { more->unpack(*holder); }).find("saved more tensors for backward than its forward did (1)"),
            std::string::npos);
}

TEST(Frame, AReplayIsJudgedByWhatRepackThrewNotByWhatReachesTheFrontDoor) {
  torch::autograd::GradMode::set_enabled(true);
  // An interpreter between the hook and the front door (TorchScript's) re-raises as its own error.
  auto rethrown = [](const std::function<void()>& replay) {
    try {
      replay();
    } catch (const std::exception&) {
      throw std::runtime_error("");
    }
  };
  auto x = at::randn({64, 64}).requires_grad_();
  auto w = at::randn({64, 64}).requires_grad_();
  auto stopping = std::make_shared<ck::Frame>("Seg", /*early_stop=*/true);
  auto hidden = x * 2;
  auto holder = stopping->pack(hidden);
  stopping->finish_forward({hidden.mm(w).relu()});
  ASSERT_TRUE(stopping->stops_early());
  stopping->set_recompute([&](ck::Frame& f, int64_t task) {
    rethrown([&] { f.repack(at::ones({64, 64}), task); });  // the last saved tensor: the replay stops
  });
  EXPECT_TRUE(stopping->unpack(*holder).equal(at::ones({64, 64})));

  auto departing = std::make_shared<ck::Frame>("Seg", false);
  holder = departing->pack(at::zeros({2}));
  departing->finish_forward({});
  departing->set_recompute([&](ck::Frame& f, int64_t task) { rethrown([&] { f.repack(at::zeros({3}), task); }); });
  EXPECT_NE(error_of([&] { departing->unpack(*holder); }).find("the replay of Seg produced saved tensor 0 (Float[3]"),
            std::string::npos);
}

TEST(Frame, EarlyStopIsDecidedByTheRecordedTailsWork) {
  torch::autograd::GradMode::set_enabled(true);
  auto x = at::randn({64, 64}).requires_grad_();
  // Records a forward whose last saved tensor is followed by `tail` (a function of it).
  auto stops_early = [&](bool early_stop, const std::function<at::Tensor(const at::Tensor&)>& tail) {
    auto frame = std::make_shared<ck::Frame>("Seg", early_stop);
    auto hidden = x * 2;
    frame->pack(hidden);  // as if the next op saved its input
    frame->finish_forward({tail(hidden)});
    return frame->stops_early();
  };
  // 1024 elements of elementwise work: not worth an exception through the segment's frames.
  EXPECT_FALSE(stops_early(true, [](const at::Tensor& h) { return h.narrow(0, 0, 16).tanh(); }));
  // A 64x64 matrix product and more: worth it (products weigh 64x per element).
  auto w = at::randn({64, 64}).requires_grad_();
  EXPECT_TRUE(stops_early(true, [&](const at::Tensor& h) { return h.mm(w).relu(); }));
  EXPECT_FALSE(stops_early(false, [&](const at::Tensor& h) { return h.mm(w).relu(); }));
}

TEST(Frame, AnEarlyStoppingReplayEndsAtTheLastSavedTensor) {
  torch::autograd::GradMode::set_enabled(true);
  auto x = at::randn({64, 64}).requires_grad_();
  auto w = at::randn({64, 64}).requires_grad_();
  auto frame = std::make_shared<ck::Frame>("Seg", true);
  auto hidden = x * 2;
  auto holder = frame->pack(hidden);
  frame->finish_forward({hidden.mm(w)});
  ASSERT_TRUE(frame->stops_early());
  bool ran_tail = false;
  frame->set_recompute([&](ck::Frame& f, int64_t task) {
    try {
      f.repack(hidden.detach(), task);
      ran_tail = true;
    } catch (const ck::StopRecomputation&) {
    }
  });
  EXPECT_TRUE(frame->unpack(*holder).equal(hidden));
  EXPECT_FALSE(ran_tail);
}

// The `save` option through the C++ front door: the replay gets the forward's matmul output itself
// (the same storage, not a recomputation), the elementwise op after it is recomputed, and the
// gradients equal the plain segment's.
TEST(Checkpoint, SavedOpOutputsAreServedToTheReplayNotRecomputed) {
  torch::manual_seed(0);
  auto weight = at::randn({8, 8}).requires_grad_();
  auto x = at::randn({4, 8}).requires_grad_();
  std::vector<const void*> matmul_data, tanh_data;
  auto segment = [&](const ck::TensorList& in) -> ck::TensorList {
    auto h = torch::mm(in[0], weight);
    auto y = torch::tanh(h);
    matmul_data.push_back(h.data_ptr());
    tanh_data.push_back(y.data_ptr());
    return {torch::mm(y, weight).sin()};
  };
  auto plain_grads = torch::autograd::grad({segment({x})[0].sum()}, {x, weight});
  matmul_data.clear();
  tanh_data.clear();

  ck::CheckpointOptions options;
  options.save = ck::SaveSpec({"aten::mm"});
  auto out = ck::checkpoint(segment, {x}, options);
  auto grads = torch::autograd::grad({out[0].sum()}, {x, weight});
  EXPECT_TRUE(same(grads, plain_grads));
  ASSERT_EQ(matmul_data.size(), 2u);  // the forward and one replay
  EXPECT_EQ(matmul_data[0], matmul_data[1]);
  EXPECT_NE(tanh_data[0], tanh_data[1]);
}

// torch::matmul of 4-D tensors returns its bmm's output through aten::_unsafe_view, whose version
// counter is the view's own: an in-place op on that result changes the saved bmm output, and the
// replay must run the bmm again instead of taking the changed scores.
TEST(Checkpoint, ASavedOutputChangedThroughMatmulsResultIsRecomputed) {
  torch::manual_seed(0);
  auto q = at::randn({2, 3, 4, 5}).requires_grad_();
  auto mask = at::randn({4, 4});
  auto segment = [&](const ck::TensorList& in) -> ck::TensorList {
    auto scores = torch::matmul(in[0], in[0].transpose(-2, -1));
    scores.add_(mask);
    return {scores.softmax(-1).select(-1, 0)};
  };
  auto plain = torch::autograd::grad({segment({q})[0].square().sum()}, {q});
  ck::CheckpointOptions options;
  options.save = ck::SaveSpec({"aten::bmm"});
  auto out = ck::checkpoint(segment, {q}, options);
  EXPECT_TRUE(same(torch::autograd::grad({out[0].square().sum()}, {q}), plain));
}

TEST(Checkpoint, SaveNamesOnlySavableOps) {
  for (const char* item : {"aten::view", "aten::linear", "aten::bernoulli.default", "aten::normal_", "no_such_family"}) {
    EXPECT_THROW(ck::SaveSpec({item}), c10::ValueError) << item;
  }
  EXPECT_EQ(ck::save_rules(ck::SaveSpec({"matmul/2"})).size(), 4u);
}

// "dropout" through the C++ front door: the replay takes the forward's mask instead of drawing it
// (a replay that moves the generator before its dropout still gets the forward's mask), and the
// gradients and the RNG stream after backward equal the plain segment's.
TEST(Checkpoint, AKeptDropoutMaskIsTheForwardsNotARedraw) {
  torch::manual_seed(0);
  auto weight = at::randn({8, 8}).requires_grad_();
  auto x = at::randn({4, 8}).requires_grad_();
  auto calls = std::make_shared<int>(0);
  auto segment = [&, calls](const ck::TensorList& in) -> ck::TensorList {
    if (++*calls == 2) at::randn({16});  // the replay only
    auto y = torch::tanh(torch::mm(in[0], weight));
    return {torch::dropout(y, 0.5, /*train=*/true).sin()};
  };
  torch::manual_seed(7);
  auto plain_grads = torch::autograd::grad({torch::dropout(torch::tanh(torch::mm(x, weight)), 0.5, true).sin().sum()},
                                           {x, weight});
  const auto plain_next = at::randn({4});

  ck::CheckpointOptions options;
  options.save = ck::SaveSpec({"dropout"});
  torch::manual_seed(7);
  auto out = ck::checkpoint(segment, {x}, options);
  auto grads = torch::autograd::grad({out[0].sum()}, {x, weight});
  EXPECT_EQ(*calls, 2);
  EXPECT_TRUE(same(grads, plain_grads));
  EXPECT_TRUE(at::randn({4}).equal(plain_next));
}

// Trains a tiny byte-level FoX (Pro) language model with AdamW on a built-in text, prints the loss
// as it falls, then generates a continuation of a prompt. Everything runs on the CPU in seconds.
//
//   fox_train_tiny [steps]      (default 60)
#include <cstdlib>
#include <iostream>
#include <string>

#include <torch/torch.h>

#include <fox/fox.h>

namespace {

const char* kText =
    "The forget gate lets each head decide how fast to forget. A head that never forgets attends "
    "to the whole context like a Transformer; a head that forgets fast looks only at its "
    "neighbours, like a recurrent network. The forget gate lets each head decide how fast to "
    "forget, and the model learns which heads should remember and which should forget. ";

torch::Tensor encode(const std::string& text) {
  auto ids = torch::empty({static_cast<int64_t>(text.size())}, torch::kLong);
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string decode(const torch::Tensor& ids) {
  std::string out;
  for (int64_t i = 0; i < ids.numel(); ++i) out += static_cast<char>(ids[i].item<int64_t>());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 60;
  torch::manual_seed(0);
  torch::set_num_threads(2);

  auto config = fox::nn::ForgettingTransformerConfig()
                    .vocab_size(256)
                    .hidden_size(64)
                    .num_hidden_layers(2)
                    .num_heads(4)
                    .preset("fox_pro");
  fox::nn::ForgettingTransformerForCausalLM model(config);
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(3e-3).betas({0.9, 0.95}).weight_decay(0.1));

  // Windows of the text: inputs are bytes t-1, labels are bytes t (the authors' convention:
  // labels[t] is the target of position t, the input at t is the previous token).
  const auto data = encode(kText);
  const int64_t window = 64, batch = 8;
  double first_loss = 0, last_loss = 0;
  for (int step = 0; step < steps; ++step) {
    auto starts = torch::randint(1, data.size(0) - window, {batch}, torch::kLong);
    std::vector<torch::Tensor> inputs, labels;
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t s = starts[b].item<int64_t>();
      inputs.push_back(data.slice(0, s - 1, s - 1 + window));
      labels.push_back(data.slice(0, s, s + window));
    }
    auto loss = model->forward(torch::stack(inputs), torch::stack(labels)).mean();
    optimizer.zero_grad();
    loss.backward();
    torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    optimizer.step();
    last_loss = loss.item<double>();
    if (step == 0) first_loss = last_loss;
    if (step % 10 == 0 || step == steps - 1)
      std::cout << "step " << step << " loss " << last_loss << std::endl;
  }

  model->eval();
  const std::string prompt = "The forget gate ";
  auto generated = fox::nn::generate(model, encode(prompt).unsqueeze(0),
                                     fox::nn::GenerationOptions().max_new_tokens(48));
  std::cout << "generated: " << decode(generated[0]) << std::endl;
  std::cout << "first_loss=" << first_loss << "\nlast_loss=" << last_loss << std::endl;
  return last_loss < first_loss ? 0 : 1;
}

// Minimal C++ host program for an `opsdk build` artifact: load model.so with libtvm_runtime,
// load the weights and transform them once (main_transform_params), read the inputs named in
// io.txt, run `main` in the Relax VM, write the outputs.
//
//   deploy_run ARTIFACT_DIR INPUT_DIR OUTPUT_DIR
//
// io.txt (written by `opsdk build`) has one line per tensor:
//   input  NAME DTYPE D0 D1 ...     (read from INPUT_DIR/NAME.bin, raw little-endian)
//   weight NAME DTYPE D0 D1 ...     (in ARTIFACT_DIR/weights.params, TVM's parameter format)
//   output NAME DTYPE D0 D1 ...     (written to OUTPUT_DIR/NAME.bin)
// Without weight lines (an artifact with its weights bundled in model.so) main takes the
// inputs only.
// A decoder artifact (`opsdk build gpt2 --weights int4`) holds its weights raw, in the
// kernels' form, in weights.bin; its io.txt adds:
//   entry     check                   (the entry run on INPUT_DIR: fresh KV caches, the
//                                      prompt's prefill, a decode step per follow token)
//   config    vocab V  /  config positions P
//   rawweight OFFSET DTYPE D0 D1 ...  (tensor i of weights.bin, at byte OFFSET)
//   uses      ENTRY I J ...           (the tensors ENTRY takes after its inputs, in order)
// and a second form generates tokens greedily (create_cache, prefill, decode, argmax):
//   deploy_run ARTIFACT_DIR --generate 464,2068,7586 N
// A symbolic dim is written as its example size; pass other sizes by editing a copy of it.
#include <tvm/ffi/container/array.h>
#include <tvm/ffi/container/map.h>
#include <tvm/ffi/container/shape.h>
#include <tvm/ffi/container/tensor.h>
#include <tvm/ffi/dtype.h>
#include <tvm/ffi/extra/module.h>
#include <tvm/ffi/function.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace ffi = tvm::ffi;

// Host tensors aligned as TVM's kernels expect (64 bytes).
struct AlignedAlloc {
  void AllocData(DLTensor* t) {
    size_t n = (ffi::GetDataSize(*t) + 63) / 64 * 64;
    t->data = std::aligned_alloc(64, n == 0 ? 64 : n);
    if (t->data == nullptr) throw std::bad_alloc();
  }
  void FreeData(DLTensor* t) { std::free(t->data); }
};

struct Spec {
  std::string role, name, dtype;
  std::vector<int64_t> shape;
};

std::vector<Spec> ReadSpecs(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<Spec> specs;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::istringstream ls(line);
    Spec s;
    ls >> s.role >> s.name;
    // entry NAME, uses ENTRY I J ..., config KEY VALUE: no dtype, the numbers as the shape
    if (s.role != "uses" && s.role != "entry" && s.role != "config") ls >> s.dtype;
    for (int64_t d; ls >> d;) s.shape.push_back(d);
    specs.push_back(s);
  }
  return specs;
}

std::vector<char> ReadFile(const std::string& path, size_t nbytes) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> buf(nbytes);
  if (!in.read(buf.data(), static_cast<std::streamsize>(nbytes)) ||
      in.peek() != std::char_traits<char>::eof()) {
    throw std::runtime_error(path + ": expected exactly " + std::to_string(nbytes) + " bytes");
  }
  return buf;
}

void Collect(const ffi::Any& value, std::vector<ffi::Tensor>* out) {
  if (auto t = value.as<ffi::Tensor>()) {
    out->push_back(*t);
  } else if (auto arr = value.as<ffi::Array<ffi::Any>>()) {
    for (const ffi::Any& v : *arr) Collect(v, out);
  } else {
    throw std::runtime_error("the entry returned something other than tensors");
  }
}

// The weights as the kernels read them: weights.params loaded, in io.txt's order, through
// main_transform_params, once. The originals are freed on return.
std::vector<ffi::Tensor> LoadWeights(const ffi::Module& vm, const std::string& art,
                                     const std::vector<Spec>& weights) {
  std::vector<ffi::Tensor> out;
  if (weights.empty()) return out;
  const std::string path = art + "/weights.params";
  if (!std::ifstream(path)) throw std::runtime_error("cannot read " + path);
  auto load = ffi::Function::GetGlobal("runtime.LoadParamsFromFile").value();
  auto params = load(path).cast<ffi::Map<ffi::String, ffi::Tensor>>();
  std::vector<ffi::AnyView> args;
  std::vector<ffi::Tensor> originals;
  for (const Spec& s : weights) {
    auto it = params.find(s.name);
    if (it == params.end()) throw std::runtime_error(path + " has no weight " + s.name);
    ffi::Tensor t = (*it).second;
    if (std::vector<int64_t>(t.shape().begin(), t.shape().end()) != s.shape) {
      throw std::runtime_error(path + ": weight " + s.name + " has another shape than io.txt");
    }
    originals.push_back(t);
  }
  for (const auto& t : originals) args.emplace_back(t);
  ffi::Any result;
  vm->GetFunction("main_transform_params").value().CallPacked(
      args.data(), static_cast<int>(args.size()), &result);
  Collect(result, &out);
  return out;
}

// A decoder's weights, in the form its kernels read: each read from weights.bin at its
// offset, in the order io.txt lists them.
std::vector<ffi::Tensor> LoadRawWeights(const std::string& art, const std::vector<Spec>& raw) {
  std::vector<ffi::Tensor> out;
  if (raw.empty()) return out;
  const std::string path = art + "/weights.bin";
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  for (const Spec& s : raw) {
    DLDataType dt = ffi::StringToDLDataType(s.dtype);
    ffi::Tensor t = ffi::Tensor::FromNDAlloc(AlignedAlloc(), ffi::Shape(s.shape), dt,
                                             DLDevice{kDLCPU, 0});
    size_t nbytes = ffi::GetDataSize(t.numel(), dt);
    in.seekg(static_cast<std::streamoff>(std::stoll(s.name)));
    if (!in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(nbytes))) {
      throw std::runtime_error(path + " is shorter than io.txt says (" + s.name + " + " +
                               std::to_string(nbytes) + " bytes)");
    }
    out.push_back(t);
  }
  return out;
}

// The tensors ENTRY takes after its inputs: the `uses ENTRY ...` line's, else every one.
std::vector<ffi::Tensor> EntryWeights(const std::vector<Spec>& specs, const std::string& entry,
                                      const std::vector<ffi::Tensor>& raw) {
  for (const Spec& s : specs) {
    if (s.role != "uses" || s.name != entry) continue;
    std::vector<ffi::Tensor> out;
    for (int64_t i : s.shape) {
      if (i < 0 || static_cast<size_t>(i) >= raw.size()) {
        throw std::runtime_error("io.txt: uses " + entry + " names tensor " +
                                 std::to_string(i) + " of " + std::to_string(raw.size()));
      }
      out.push_back(raw[static_cast<size_t>(i)]);
    }
    return out;
  }
  return raw;
}

int64_t Config(const std::vector<Spec>& specs, const std::string& key) {
  for (const Spec& s : specs) {
    if (s.role == "config" && s.name == key && s.shape.size() == 1) return s.shape[0];
  }
  throw std::runtime_error("io.txt has no 'config " + key + "' line: not a decoder artifact");
}

ffi::Function Entry(const ffi::Module& vm, const std::string& name) {
  auto found = vm->GetFunction(name);
  if (!found) throw std::runtime_error("model.so has no function " + name);
  return *found;
}

// Greedy generation with the decoder's own entries: create_cache(capacity), prefill(tokens,
// total, caches..., weights...) -> (logits, caches...), then decode one token at a time.
int Generate(const ffi::Module& vm, const std::vector<Spec>& specs,
             const std::vector<ffi::Tensor>& raw, const std::string& prompt_text, int steps) {
  const int64_t vocab = Config(specs, "vocab"), positions = Config(specs, "positions");
  std::vector<int32_t> tokens;
  std::stringstream ps(prompt_text);
  for (std::string tok; std::getline(ps, tok, ',');) {
    size_t used = 0;
    int64_t v = -1;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
    }
    if (used != tok.size() || v < 0 || v >= vocab) {
      throw std::runtime_error("--generate: '" + tok + "' is not a token id in [0, " +
                               std::to_string(vocab) + ")");
    }
    tokens.push_back(static_cast<int32_t>(v));
  }
  if (tokens.empty() || steps < 1 ||
      static_cast<int64_t>(tokens.size()) + steps > positions) {
    throw std::runtime_error("--generate: give 1+ prompt tokens and N >= 1 with prompt + N <= " +
                             std::to_string(positions) + " positions");
  }
  ffi::Function prefill = Entry(vm, "prefill"), decode = Entry(vm, "decode");
  std::vector<ffi::Tensor> w_prefill = EntryWeights(specs, "prefill", raw);
  std::vector<ffi::Tensor> w_decode = EntryWeights(specs, "decode", raw);
  // The KV caches are runtime objects (TVM's attention KV cache), passed back as they come.
  std::vector<ffi::Any> caches;
  for (const ffi::Any& c : Entry(vm, "create_cache")(ffi::Shape({std::min<int64_t>(
           positions, 256)})).cast<ffi::Array<ffi::Any>>()) {
    caches.push_back(c);
  }
  DLDevice cpu{kDLCPU, 0};
  int64_t total = 0;
  std::vector<int32_t> feed = tokens;
  for (int step = 0; step < steps; ++step) {
    auto n = static_cast<int64_t>(feed.size());
    ffi::Tensor ids = ffi::Tensor::FromNDAlloc(AlignedAlloc(), ffi::Shape({1, n}),
                                               DLDataType{kDLInt, 32, 1}, cpu);
    std::memcpy(ids.data_ptr(), feed.data(), feed.size() * sizeof(int32_t));
    total += n;
    ffi::Shape length({total});
    std::vector<ffi::AnyView> args{ids, length};
    for (const auto& c : caches) args.emplace_back(c);
    for (const auto& t : (n == 1 ? w_decode : w_prefill)) args.emplace_back(t);
    ffi::Any result;
    (n == 1 ? decode : prefill).CallPacked(args.data(), static_cast<int>(args.size()), &result);
    auto outs = result.cast<ffi::Array<ffi::Any>>();  // (logits (1, vocab), caches...)
    ffi::Tensor out0 = outs[0].cast<ffi::Tensor>();
    const auto* logits = static_cast<const float*>(out0.data_ptr());
    int32_t best = static_cast<int32_t>(std::max_element(logits, logits + vocab) - logits);
    caches.assign(outs.begin() + 1, outs.end());
    std::cout << (step ? "," : "") << best;
    feed.assign(1, best);
  }
  std::cout << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const bool generate = argc == 5 && std::string(argv[2]) == "--generate";
  if (argc != 4 && !generate) {
    std::cerr << "usage: " << argv[0] << " ARTIFACT_DIR INPUT_DIR OUTPUT_DIR\n"
              << "       " << argv[0] << " ARTIFACT_DIR --generate TOKEN,TOKEN,... N\n";
    return 2;
  }
  const std::string art = argv[1], in_dir = argv[2], out_dir = argv[3];
  // TVM's workers unpinned (before its pool starts at the first run): a worker pinned to a
  // core that another process shares stalls every kernel (docs/deployment.md). An explicit
  // TVM_BIND_THREADS in the environment wins.
  setenv("TVM_BIND_THREADS", "0", /*overwrite=*/0);
  try {
    DLDevice cpu{kDLCPU, 0};
    // The artifact is a Relax VM executable; its kernels and weights are in the same file.
    ffi::Module lib = ffi::Module::LoadFromFile(art + "/model.so");
    ffi::Module vm = lib->GetFunction("vm_load_executable").value()().cast<ffi::Module>();
    // Device type, id, allocator (2: pooled) for the CPU, the VM's only device here.
    vm->GetFunction("vm_initialization").value()(static_cast<int>(kDLCPU), 0, 2);
    std::vector<Spec> specs = ReadSpecs(art + "/io.txt");
    if (generate) {
      std::vector<Spec> raw_all;
      for (const Spec& s : specs) {
        if (s.role == "rawweight") raw_all.push_back(s);
      }
      return Generate(vm, specs, LoadRawWeights(art, raw_all), argv[3], std::atoi(argv[4]));
    }
    std::string entry = "main";
    std::vector<ffi::AnyView> args;
    std::vector<ffi::Tensor> inputs;
    std::vector<Spec> outs, weight_specs, raw_specs;
    for (const Spec& s : specs) {
      if (s.role == "entry") {
        entry = s.name;
        continue;
      }
      if (s.role == "output") {
        outs.push_back(s);
        continue;
      }
      if (s.role == "weight") {
        weight_specs.push_back(s);
        continue;
      }
      if (s.role == "rawweight") {
        raw_specs.push_back(s);
        continue;
      }
      if (s.role != "input") continue;  // config, uses: a decoder's generate loop
      DLDataType dt = ffi::StringToDLDataType(s.dtype);
      ffi::Shape shape(s.shape);
      ffi::Tensor t = ffi::Tensor::FromNDAlloc(AlignedAlloc(), shape, dt, cpu);
      size_t nbytes = ffi::GetDataSize(t.numel(), dt);
      std::vector<char> data = ReadFile(in_dir + "/" + s.name + ".bin", nbytes);
      std::memcpy(t.data_ptr(), data.data(), nbytes);
      inputs.push_back(t);
    }
    // Once per process: every later call of main reuses the transformed weights.
    std::vector<ffi::Tensor> weights = LoadWeights(vm, art, weight_specs);
    std::vector<ffi::Tensor> raw = EntryWeights(specs, entry, LoadRawWeights(art, raw_specs));
    for (const auto& t : inputs) args.emplace_back(t);
    for (const auto& t : weights) args.emplace_back(t);
    for (const auto& t : raw) args.emplace_back(t);
    ffi::Function run = Entry(vm, entry);
    ffi::Any result;
    run.CallPacked(args.data(), static_cast<int>(args.size()), &result);

    std::vector<ffi::Tensor> results;
    Collect(result, &results);
    if (results.size() != outs.size()) {
      throw std::runtime_error(entry + " returned " + std::to_string(results.size()) +
                               " tensors, io.txt lists " + std::to_string(outs.size()));
    }
    for (size_t i = 0; i < results.size(); ++i) {
      const ffi::Tensor& t = results[i];  // a CPU tensor the VM allocated, contiguous
      size_t nbytes = ffi::GetDataSize(t.numel(), t.dtype());
      std::string path = out_dir + "/" + outs[i].name + ".bin";
      std::ofstream f(path, std::ios::binary);
      if (!f.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(nbytes))) {
        throw std::runtime_error("cannot write " + path);
      }
      std::cout << outs[i].name << ": " << t.ndim() << "-d " << outs[i].dtype << ", " << nbytes
                << " bytes -> " << path << "\n";
    }
  } catch (const std::exception& e) {
    std::cerr << "deploy_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

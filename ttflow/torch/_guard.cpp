// What torch needs in C++ from a backend before "tt" (PrivateUse1) tensors behave like CUDA's:
// a device guard (tensor creation, autograd's device threads), the PrivateUse1 hooks (autograd
// asks them whether the device has a context), an allocator, and the kernels that only touch
// metadata (empty, as_strided, set_), which cannot be written in Python.
//
// A tt tensor is an ordinary torch tensor whose storage holds no host bytes: the allocator hands
// out unique, never-dereferenced addresses, and ttflow.torch keeps the storage's value (a
// ttflow tensor on the emulated device) in a table keyed by that address. Views, in-place ops,
// state_dict aliasing, torch.save and dynamo then work as they do for CUDA. When torch frees a
// storage, its address goes on a list that Python drains (`ttflow_take_freed`), so the device
// value is released without calling into Python from whichever thread freed it.
//
// ttflow's device is driven from Python, so the guard only tracks the current device index
// (per thread, as CUDA's does) and hands out the default stream. Loading the shared library
// registers everything through static initializers.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/native/Resize.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_set>
#include <vector>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
// ttflow.torch opens at most this many devices. The guard reports this many to torch, whose
// autograd engine starts one device thread per index at the first backward, so it never changes;
// torch.tt.device_count() is Python's count of the devices that can be used (`open_devices`).
constexpr c10::DeviceIndex kMaxDevices = 8;
thread_local c10::DeviceIndex current_index = 0;

// How many tt devices can be used now (tt:0 to tt:n-1: tt:0 opens on first use, the others once
// opened), set by Python (`ttflow_set_device_count`) as devices open and close. A tensor made on
// a device past them is refused here, when it is made, as CUDA refuses an invalid ordinal.
std::atomic<int> open_devices{1};

void check_open(c10::DeviceIndex index) {
  int count = open_devices.load();
  TORCH_CHECK(index < count, "tt:", static_cast<int>(index), " is not open: torch.tt.device_count() is ", count,
              " (tt:0 to tt:", count - 1, "); ttflow.torch.open_device() opens the next one, tt:", count);
}

// Waiting for the device is Python's (ttflow.torch.synchronize): it registers a function here
// (`ttflow_set_synchronize`, through ctypes, which takes the GIL to call it). It returns 0, or
// non-zero with the queued op's error in `message`. Until then there is nothing to wait for.
using SynchronizeFn = int (*)(int8_t device_index, char* message, size_t capacity);
std::atomic<SynchronizeFn> synchronize_fn{nullptr};

void synchronize_device(c10::DeviceIndex index) {
  SynchronizeFn fn = synchronize_fn.load();
  if (fn == nullptr) return;
  char message[2048] = {0};
  TORCH_CHECK(fn(static_cast<int8_t>(index), message, sizeof(message) - 1) == 0, message);
}

struct TTGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kType; }

  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kType, current_index);
    if (d.index() >= 0) current_index = d.index();
    return old;
  }

  c10::Device getDevice() const override { return c10::Device(kType, current_index); }

  void setDevice(c10::Device d) const override {
    if (d.index() >= 0) current_index = d.index();
  }

  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0) current_index = d.index();
  }

  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, d);
  }

  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, s.device());
  }

  c10::DeviceIndex deviceCount() const noexcept override { return kMaxDevices; }

  // Work is ordered by ttflow's own command queues; torch never needs to wait on events here.
  void record(void**, const c10::Stream&, const c10::DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  // `torch.tt.current_stream().synchronize()`, `torch.accelerator.synchronize()`: everything
  // queued on the device has run (one in-order stream per device, as ttflow's queues are).
  void synchronizeStream(const c10::Stream& stream) const override { synchronize_device(stream.device_index()); }
  void synchronizeDevice(const c10::DeviceIndex index) const override { synchronize_device(index); }
};

// "Pinned" host memory (`pin_memory()`, `DataLoader(pin_memory=True)`): the emulated device
// copies from any host memory, so it is ordinary CPU memory, remembered so `is_pinned()` is true.
std::mutex pinned_mutex;
std::unordered_set<void*> pinned;

void release_pinned(void* ptr) {
  {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    pinned.erase(ptr);
  }
  std::free(ptr);
}

struct PinnedAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    void* ptr = nbytes ? std::aligned_alloc(64, (nbytes + 63) / 64 * 64) : nullptr;
    TORCH_CHECK(nbytes == 0 || ptr != nullptr, "out of host memory pinning ", nbytes, " bytes");
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(pinned_mutex);
      pinned.insert(ptr);
    }
    return {ptr, ptr, &release_pinned, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_pinned; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

PinnedAllocator pinned_allocator;

// `torch.Generator(device="tt")`: CPU's generator (the same Mersenne Twister, seeds and states)
// that says it is a tt device's. ttflow.torch draws tt random fills on the host, so its Python
// side runs the host op with a CPU generator in this one's state and writes the state back: a tt
// generator seeded s draws what a CPU generator seeded s draws, as the default generators do.
struct TTGeneratorImpl final : public at::CPUGeneratorImpl {
  TTGeneratorImpl(c10::DeviceIndex index, uint64_t seed) : at::CPUGeneratorImpl(seed) {
    device_ = c10::Device(kType, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
  // No Philox offset, as for CPU; but pickling (copy.deepcopy, torch.save) of a non-CPU
  // generator asks for one, so it is 0 and only 0 may be set.
  uint64_t get_offset() const override { return 0; }
  void set_offset(uint64_t offset) override {
    TORCH_CHECK(offset == 0, "a tt generator has no offset (it is CPU's Mersenne Twister)");
  }

 private:
  TTGeneratorImpl* clone_impl() const override {
    auto* copy = new TTGeneratorImpl(device_.index(), current_seed());
    auto* self = const_cast<TTGeneratorImpl*>(this);  // engine() and the samples are not const
    copy->set_engine(self->engine());
    copy->set_next_float_normal_sample(self->next_float_normal_sample());
    copy->set_next_double_normal_sample(self->next_double_normal_sample());
    return copy;
  }
};

struct TTHooks final : public at::PrivateUse1HooksInterface {
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return at::make_generator<TTGeneratorImpl>(index < 0 ? current_index : index, c10::default_rng_seed_val);
  }
  bool isPinnedPtr(const void* data) const override {
    std::lock_guard<std::mutex> lock(pinned_mutex);
    return pinned.count(const_cast<void*>(data)) != 0;
  }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kMaxDevices; }
  c10::DeviceIndex getCurrentDevice() const override { return current_index; }
  void setCurrentDevice(c10::DeviceIndex d) const override { current_index = d; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = current_index;
    current_index = d;
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override { return exchangeDevice(d); }
};

// Addresses start high and step by 4 KiB per allocation: unique while the process lives (2^40
// allocations), recognisable in a debugger, and never dereferenced (nothing reads tt memory on
// the host: every kernel that reads a tt tensor is ttflow's).
std::atomic<uint64_t> next_address{uint64_t{1} << 52};
std::mutex freed_mutex;
std::vector<uint64_t> freed;
std::atomic<uint64_t> live_storages{0};

void release(void* ptr) {
  std::lock_guard<std::mutex> lock(freed_mutex);
  freed.push_back(reinterpret_cast<uint64_t>(ptr));
  live_storages.fetch_sub(1);
}

struct TTAllocator final : public c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    c10::Device device(kType, current_index);
    if (nbytes == 0) return {nullptr, device};
    void* ptr = reinterpret_cast<void*>(next_address.fetch_add(4096));
    live_storages.fetch_add(1);
    return {ptr, ptr, &release, device};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release; }
  void copy_data(void*, const void*, std::size_t) const override {
    TORCH_CHECK(false, "tt storages hold no host bytes; ttflow.torch copies them");
  }
};

TTAllocator allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &allocator);

at::Tensor empty_tt(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                    std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                    std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "tt tensors are strided");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  check_open(current_index);
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_generic(size, &allocator, keys, c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided_tt(c10::IntArrayRef size, c10::IntArrayRef stride,
                            std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                            std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "tt tensors are strided");
  const c10::DeviceGuard guard(c10::device_or_default(device));
  check_open(current_index);
  constexpr c10::DispatchKeySet keys(c10::DispatchKey::PrivateUse1);
  return at::detail::empty_strided_generic(size, stride, &allocator, keys, c10::dtype_or_default(dtype));
}

// Metadata only: the CPU kernels never touch the bytes.
at::Tensor as_strided_tt(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<int64_t> offset) {
  return at::cpu::as_strided(self, size, stride, offset);
}

at::Tensor& set_tt(at::Tensor& self, at::Storage storage, int64_t offset, c10::IntArrayRef size,
                   c10::IntArrayRef stride) {
  return at::cpu::set_(self, storage, offset, size, stride);
}

// A resize that needs more bytes gets a fresh storage (its old value is gone, as after CUDA's
// resize_ the new elements are uninitialised); one that fits keeps the storage. The storage is
// allocated on the tensor's own device, not the current one: the tensor takes its storage's
// device, and every structured op's `out=` tensor (`abs`, `arange`, `eye`) is resized so.
const at::Tensor& resize_tt(const at::Tensor& self, c10::IntArrayRef size,
                            std::optional<c10::MemoryFormat> memory_format) {
  const c10::DeviceGuard guard(self.device());
  auto* impl = self.unsafeGetTensorImpl();
  int64_t numel = c10::multiply_integers(size);
  size_t needed = static_cast<size_t>(numel + impl->storage_offset()) * self.dtype().itemsize();
  if (needed > impl->storage().nbytes()) {
    impl->set_storage_keep_dtype(c10::Storage(c10::Storage::use_byte_size_t(), needed,
                                              allocator.allocate(needed), &allocator, true));
  }
  impl->set_sizes_contiguous(size);
  return self;
}

// `module.to("tt")` keeps each Parameter object, as it does for CUDA: weights tied by sharing one
// Parameter stay tied, and an optimizer made before the move still holds the model's parameters.
// torch asks this op whether `param.data = moved` may swap the tensor under the object; its own
// answer knows only torch's built-in dense backends, so without this every Parameter is replaced.
bool compatible_tt(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::Layout::Strided && !t.is_quantized() &&
           (t.device().is_cpu() || t.device().type() == kType);
  };
  return self.key_set() == from.key_set() || (dense(self) && dense(from));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", compatible_tt);
  m.impl("empty.memory_format", empty_tt);
  m.impl("empty_strided", empty_strided_tt);
  m.impl("as_strided", as_strided_tt);
  m.impl("set_.source_Storage_storage_offset", set_tt);
  m.impl("resize_", resize_tt);
}

// `torch.autocast("tt")`: the ops CUDA autocasts, with CUDA's policies (matmuls and convolutions in
// the lower precision, reductions and losses in float32); every other op falls through.
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

namespace tt_autocast {
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;
using namespace at::autocast;

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define TT_LOWER_PRECISION(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define TT_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define TT_FP32_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define TT_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_LOWER_PRECISION_FP(TT_LOWER_PRECISION)
  AT_FORALL_FP32(TT_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(TT_FP32_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  AT_FORALL_PROMOTE(TT_PROMOTE)
}
}  // namespace tt_autocast

struct Registrar {
  Registrar() { at::RegisterPrivateUse1HooksInterface(new TTHooks()); }
};
Registrar registrar;

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, TTGuardImpl);

extern "C" int ttflow_torch_guard_version() { return 4; }

// Moves up to `capacity` freed storage addresses into `out`; returns how many.
extern "C" size_t ttflow_take_freed(uint64_t* out, size_t capacity) {
  std::lock_guard<std::mutex> lock(freed_mutex);
  size_t n = freed.size() < capacity ? freed.size() : capacity;
  for (size_t i = 0; i < n; ++i) out[i] = freed[freed.size() - n + i];
  freed.resize(freed.size() - n);
  return n;
}

extern "C" uint64_t ttflow_live_storages() { return live_storages.load(); }

extern "C" void ttflow_set_synchronize(SynchronizeFn fn) { synchronize_fn.store(fn); }

extern "C" void ttflow_set_device_count(int count) { open_devices.store(count); }

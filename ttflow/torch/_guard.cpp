// What torch needs from a backend before it will make tensors on PrivateUse1 ("tt"): a device
// guard (tensor creation, autograd's device threads) and the PrivateUse1 hooks (autograd asks
// them whether the device has a context).
//
// ttflow's device is driven from Python, so the guard only tracks the current device index
// (per thread, as CUDA's does) and hands out the default stream. Loading the shared library
// registers both through static initializers; nothing in it is called from Python.
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {

constexpr c10::DeviceType kType = c10::DeviceType::PrivateUse1;
constexpr c10::DeviceIndex kMaxDevices = 8;  // ttflow.torch opens at most this many devices
thread_local c10::DeviceIndex current_index = 0;

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
  void synchronizeStream(const c10::Stream&) const override {}
};

struct TTHooks final : public at::PrivateUse1HooksInterface {
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

struct Registrar {
  Registrar() { at::RegisterPrivateUse1HooksInterface(new TTHooks()); }
};
Registrar registrar;

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, TTGuardImpl);

extern "C" int ttflow_torch_guard_version() { return 1; }

defmodule ExlaRs.NIFTest do
  use ExUnit.Case, async: true

  alias ExlaRs.NIF

  test "the NIF is loaded from priv/native" do
    assert NIF.load_error() == nil
    assert File.exists?(NIF.nif_path() <> ".so")
    assert %{version: "0.1.0", ffi_api_version: {0, 1}} = NIF.native_info()
  end

  test "workspace_bytes answers the contract's three kinds of value" do
    # f32 forward on the Host: supported (>= 0).
    {:ok, f32} = ExlaRs.CustomCall.ffi_dtype({:f, 32})
    assert NIF.workspace_bytes(0, 0, f32, 1, 16, 16, 2, 1, 64) >= 0
    # An unknown dtype code: unsupported.
    assert NIF.workspace_bytes(0, 0, 99, 1, 16, 16, 2, 1, 64) == -1
  end

  test "flash_attn_features answers a bit set of the contract's optional features" do
    bits = NIF.feature_bits()
    assert Enum.sort(Map.keys(bits)) == [:alibi_slopes, :bias, :bias_grad, :dropout, :key_mask]
    # One distinct bit each.
    assert bits |> Map.values() |> Enum.map(&:math.log2/1) |> Enum.all?(&(&1 == Float.round(&1)))
    assert bits |> Map.values() |> Enum.uniq() |> length() == 5
    all = bits |> Map.values() |> Enum.sum()

    # The Host runs every feature (the contract); CUDA some subset; other codes -1.
    assert NIF.flash_attn_features(0) == all
    cuda = NIF.flash_attn_features(1)
    assert cuda >= 0 and Bitwise.band(cuda, Bitwise.bnot(all)) == 0
    assert NIF.flash_attn_features(2) == -1
    assert NIF.flash_attn_features(-1) == -1
    assert_raise ArgumentError, fn -> NIF.flash_attn_features(:host) end
  end

  test "bad arguments raise ArgumentError, not a crash" do
    assert_raise ArgumentError, fn -> NIF.workspace_bytes(:f32, 0, 0, 1, 16, 16, 2, 1, 64) end
    assert_raise ArgumentError, fn -> NIF.register(:not_a_list, false) end
  end

  test "a panic in Rust comes back as {:error, reason}; the VM lives on" do
    assert {:error, "exla_rs internal error in panic_for_test: deliberate panic"} =
             NIF.panic_for_test()

    assert %{ffi_api_version: {0, 1}} = NIF.native_info()
  end

  test "loading something that is not a plugin is a clear error" do
    assert {:error, reason} = NIF.load_pjrt_plugin("/nonexistent/plugin.so")
    assert reason =~ "cannot load /nonexistent/plugin.so"
    libc = "/lib/x86_64-linux-gnu/libc.so.6"

    if File.exists?(libc) do
      assert {:error, reason} = NIF.load_pjrt_plugin(libc)
      assert reason =~ "does not export GetPjrtApi"
    end
  end
end

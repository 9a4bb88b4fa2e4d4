# Run with `mix run` inside a throwaway user project that depends on exla_rs (see
# test/exla_rs/user_project_test.exs). Argument: which optional libraries the project has,
# e.g. "nx,exla,axon" or "" (none). Prints "CHECK OK" and exits 0 when exla_rs is complete for
# those libraries; otherwise raises with the reason (non-zero exit).
have = System.argv() |> List.first("") |> String.split(",", trim: true) |> Enum.map(&String.to_atom/1)

check = fn ok?, what -> unless ok?, do: raise("CHECK FAILED: " <> what) end
exported? = fn mod, fun, arity -> Code.ensure_loaded?(mod) and function_exported?(mod, fun, arity) end

# The native side loads and answers whatever else the project has.
check.(ExlaRs.NIF.load_error() == nil, "the NIF did not load: #{ExlaRs.NIF.load_error()}")
check.(is_map(ExlaRs.status()), "ExlaRs.status/0")

nx? = :nx in have
check.(exported?.(ExlaRs, :attention, 4) == nx?, "ExlaRs.attention/4 exported: expected #{nx?}")
check.(exported?.(ExlaRs, :attention_with_lse, 4) == nx?, "ExlaRs.attention_with_lse/4 exported: expected #{nx?}")
axon? = :axon in have
check.(exported?.(ExlaRs.Axon, :attention, 4) == axon?, "ExlaRs.Axon.attention/4 exported: expected #{axon?}")

if nx? do
  Code.require_file(Path.join(System.fetch_env!("EXLA_RS_REPO"), "test/nx/support.exs"))
  alias ExlaRs.NxTest.Reference, as: Ref

  # A jitted call and its gradient (the Nx fallback: no EXLA NIF here) against float64.
  key = Nx.Random.key(System.unique_integer([:positive]))
  {q, key} = Nx.Random.normal(key, shape: {2, 5, 4, 16}, type: :f32)
  {k, key} = Nx.Random.normal(key, shape: {2, 7, 2, 16}, type: :f32)
  {v, key} = Nx.Random.normal(key, shape: {2, 7, 2, 16}, type: :f32)
  {w, _key} = Nx.Random.normal(key, shape: {2, 5, 4, 16}, type: :f64)
  opts = [causal: true, window_size: {4, 0}]

  o = Nx.Defn.jit(fn q, k, v -> ExlaRs.attention(q, k, v, opts) end).(q, k, v)
  {ro, _rlse} = Ref.forward(q, k, v, opts)
  Ref.assert_close(o, ro, 2.0e-5, 2.0e-5, "jitted o")

  grads =
    Nx.Defn.jit(fn q, k, v, w ->
      Nx.Defn.grad({q, k, v}, fn {q, k, v} -> Nx.sum(Nx.multiply(ExlaRs.attention(q, k, v, opts), w)) end)
    end).(q, k, v, w)

  mask = Ref.mask(q, k, opts)
  c = Ref.config(q, k, opts)

  want =
    Nx.Defn.jit(fn q, k, v, w, mask ->
      Nx.Defn.grad({q, k, v}, fn {q, k, v} -> Nx.sum(Nx.multiply(elem(Ref.naive(q, k, v, mask, c), 0), w)) end)
    end).(Nx.as_type(q, :f64), Nx.as_type(k, :f64), Nx.as_type(v, :f64), w, mask)

  for {name, g, r} <- Enum.zip([[:dq, :dk, :dv], Tuple.to_list(grads), Tuple.to_list(want)]) do
    atol = 2.0e-5 * max(1.0, r |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number())
    Ref.assert_close(g, r, atol, 1.0e-4, "jitted #{name}")
  end

  if :exla in have do
    # Our implementation after protocol consolidation, for both tags.
    check.(Protocol.consolidated?(EXLA.CustomCall), "EXLA.CustomCall is not consolidated")
    %{blocks: blocks} =
      Nx.Defn.debug_expr(fn q, k, v, w ->
        Nx.Defn.value_and_grad({q, k, v}, fn {q, k, v} -> Nx.sum(Nx.multiply(ExlaRs.attention(q, k, v, opts), w)) end)
      end).(q, k, v, Nx.as_type(w, :f32))
      |> Ref.walk()

    for {tag, _args, _out} <- blocks do
      impl = EXLA.CustomCall.impl_for(tag)
      check.(impl == Module.concat(EXLA.CustomCall, tag.__struct__), "impl_for(#{inspect(tag.__struct__)}) is #{inspect(impl)}")
    end

    # With a real XLA runtime in the VM (a PJRT CPU plugin), EXLA's :host client gets our calls.
    {:ok, _} = ExlaRs.load_pjrt_plugin(System.fetch_env!("EXLA_RS_PJRT_PLUGIN"))
    # (struct/2, not %EXLA.Client{}: this script also runs in projects without EXLA.)
    client = struct(EXLA.Client, ref: nil, platform: :host, name: :host, device_count: 1, default_device_id: 0)

    targets =
      for {tag, args, out} <- blocks do
        case EXLA.CustomCall.call(tag, out, args, client) do
          {:ok, %{__struct__: EXLA.CustomCall.Spec, call_target_name: target}} -> target
          other -> raise "CHECK FAILED: EXLA.CustomCall.call/4 on :host for #{inspect(tag)}: #{inspect(other)}"
        end
      end

    check.(Enum.sort(targets) == ["exla_rs_flash_attn_bwd", "exla_rs_flash_attn_fwd"], "targets: #{inspect(targets)}")
  end

  if axon? do
    input = Axon.input("x", shape: {nil, 5, 4, 16})
    model = ExlaRs.Axon.attention(input, input, input, causal: true)
    {init_fn, predict_fn} = Axon.build(model)
    state = init_fn.(Nx.template({2, 5, 4, 16}, :f32), Axon.ModelState.empty())
    out = predict_fn.(state, q)
    {ro, _} = Ref.forward(q, q, q, causal: true)
    Ref.assert_close(out, ro, 2.0e-5, 2.0e-5, "Axon layer")
  end
end

IO.puts("CHECK OK")

Code.require_file("support.exs", __DIR__)

# Every Bumblebee 0.7.0 architecture that computes attention, as a tiny random model on
# Nx.BinaryBackend with padded random inputs: the swapped model fuses every attention and
# computes what Bumblebee computes: outputs on visible positions, gradients with respect to
# every parameter, and greedy generation with the KV cache.
#
# The architectures are dealt round-robin to @parts modules: a module's tests run one after
# another, modules side by side, so the 41 architectures share CI's cores instead of forming the
# run's longest serial chain. Each architecture's model is built and swapped once, not once per test.
parts = 3

for part <- 0..(parts - 1) do
  defmodule Module.concat(ExlaRs.BumblebeeArchitecturesTest, "Part#{part}") do
    use ExUnit.Case, async: true
    @moduletag :bumblebee
    @moduletag timeout: 600_000

    alias ExlaRs.BumblebeeTest.Harness

    setup_all do
      Nx.default_backend(Nx.BinaryBackend)

      # Built models by architecture name, for this module's tests (setup_all's process, and so the
      # table, lives until the module's last test is done).
      %{built: :ets.new(:built_architectures, [:public, :set])}
    end

    # The architecture's model, inputs and swapped model: built on its first test, then reused.
    defp built(table, entry) do
      case :ets.lookup(table, entry.name) do
        [{_, built}] ->
          built

        [] ->
          {info, inputs, masks} = Harness.build(entry)
          {swapped, report} = ExlaRs.Bumblebee.swap_attention(info, seed: 1)
          built = %{info: info, swapped: swapped, report: report, inputs: inputs, masks: masks}
          :ets.insert(table, {entry.name, built})
          built
      end
    end

    # EXLA_RS_BUMBLEBEE_DIFFS=1 prints each architecture's measured differences.
    defp note(name, what, value) do
      if System.get_env("EXLA_RS_BUMBLEBEE_DIFFS"),
        do: IO.puts("\n[diff] #{name} #{what} #{inspect(value)}")
    end

    for entry <- Harness.all() |> Enum.drop(part) |> Enum.take_every(parts) do
      @entry entry

      describe entry.name do
        setup %{built: table} do
          built(table, @entry)
        end

        test "every attention is fused", %{info: info, swapped: swapped, report: report} do
          bumblebee = count_ops(info.model, :attention_output_impl)

          assert bumblebee == @entry.attentions,
                 "Bumblebee built #{bumblebee} attentions, the table expects #{@entry.attentions}"

          assert report.swapped == bumblebee
          assert report.skipped == []
          assert Enum.sum(Map.values(report.kinds)) == bumblebee
          assert count_ops(swapped.model, :attention_output_impl) == 0
          assert Axon.get_op_counts(swapped.model)[:exla_rs_attention] == bumblebee
          # Parameters untouched: the same map serves both models.
          assert swapped.params == info.params
        end

        test "outputs equal on visible positions", %{
          info: info,
          swapped: swapped,
          inputs: inputs,
          masks: masks
        } do
          want = Harness.predict(info, inputs)
          got = Harness.predict(swapped, inputs)

          note(
            @entry.name,
            "outputs max abs diff",
            Harness.assert_close!(got, want, masks, "outputs")
          )
        end

        if Map.get(entry, :grad, true) do
          test "gradients equal for every parameter", %{
            info: info,
            swapped: swapped,
            inputs: inputs,
            masks: masks
          } do
            want = info |> Harness.grads(inputs, masks) |> Harness.flat_params()
            got = swapped |> Harness.grads(inputs, masks) |> Harness.flat_params() |> Map.new()
            assert length(want) > 0
            assert Map.keys(got) |> Enum.sort() == want |> Enum.map(&elem(&1, 0)) |> Enum.sort()

            scale =
              want
              |> Enum.map(fn {_, w} -> w |> Nx.abs() |> Nx.reduce_max() |> Nx.to_number() end)
              |> Enum.max()

            tolerance = Harness.gradient_tolerance(scale)

            worst =
              for {path, w} <- want, reduce: 0.0 do
                worst ->
                  max(
                    worst,
                    Harness.assert_close!(
                      got[path],
                      w,
                      [],
                      "gradient #{Enum.join(path, "/")}",
                      tolerance
                    )
                  )
              end

            note(@entry.name, "gradients max abs diff", {worst, :largest_gradient, scale})
          end
        end

        if entry.generate do
          test "greedy generation with the KV cache gives the same tokens", %{
            info: info,
            swapped: swapped,
            inputs: inputs
          } do
            inputs = Map.drop(inputs, ["decoder_input_ids"])
            want = Harness.generate(info, inputs)
            got = Harness.generate(swapped, inputs)
            assert Nx.to_list(got.token_ids) == Nx.to_list(want.token_ids)
            assert Nx.to_list(got.length) == Nx.to_list(want.length)
            note(@entry.name, "generated", Nx.to_list(want.token_ids))
          end
        end
      end
    end

    defp count_ops(model, fun) do
      Axon.reduce_nodes(model, 0, fn node, n ->
        if ExlaRs.Bumblebee.Graph.bumblebee_fun?(node.op, fun), do: n + 1, else: n
      end)
    end
  end
end

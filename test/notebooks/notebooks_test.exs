defmodule ExlaRs.NotebooksTest do
  # Every Livebook notebook in notebooks/ runs here as a user runs it: each ```elixir cell in
  # order, with the aliases, imports and variables of the cells before it (Livebook's
  # evaluation chain), against this project's test dependencies. The setup cell (Mix.install)
  # is replaced by those dependencies. EXLA here is its Elixir side without XLA, so the cells
  # guard what needs a real EXLA client (`Code.ensure_loaded?(EXLA)`) and the rest runs on
  # Nx.BinaryBackend with Nx.Defn.Evaluator. Models: EXLA_RS_NOTEBOOK_OFFLINE tells the
  # notebooks to build tiny random ones (with the test tokenizer) instead of downloading.
  use ExUnit.Case, async: false
  @moduletag :notebooks
  @moduletag timeout: 600_000

  @root Path.expand("../..", __DIR__)
  @notebooks @root |> Path.join("notebooks/*.livemd") |> Path.wildcard() |> Enum.sort()
  @tokenizer_dir Path.join(@root, "test/data/bumblebee_tokenizer")

  defmodule Livemd do
    @moduledoc false

    @doc """
    The ```elixir cells of a .livemd file: [%{index:, line:, code:}] (index from 1). A block
    after `<!-- livebook:{"force_markdown":true} -->` is Markdown in Livebook, not a cell.
    """
    def cells(path) do
      path
      |> File.read!()
      |> String.split("\n")
      |> Enum.with_index(1)
      |> Enum.reduce({[], nil, nil}, fn
        {"```elixir", line}, {cells, nil, previous} -> {cells, {line, [], markdown?(previous)}, nil}
        {"```", _line}, {cells, {start, lines, markdown?}, _} -> {[{start, Enum.reverse(lines), markdown?} | cells], nil, nil}
        {text, _line}, {cells, {start, lines, markdown?}, _} -> {cells, {start, [text | lines], markdown?}, nil}
        {"", _line}, {cells, nil, previous} -> {cells, nil, previous}
        {text, _line}, {cells, nil, _previous} -> {cells, nil, text}
      end)
      |> case do
        {cells, nil, _} -> cells
        {_cells, {start, _, _}, _} -> raise "#{path}:#{start}: unterminated ```elixir cell"
      end
      |> Enum.reject(fn {_start, _lines, markdown?} -> markdown? end)
      |> Enum.map(fn {start, lines, _} -> {start, lines} end)
      |> Enum.reverse()
      |> Enum.with_index(1)
      |> Enum.map(fn {{line, lines}, index} -> %{index: index, line: line, code: Enum.join(lines, "\n")} end)
    end

    defp markdown?(previous), do: previous != nil and previous =~ ~s(<!-- livebook:{"force_markdown":true} -->)
  end

  setup_all do
    previous = System.get_env("EXLA_RS_NOTEBOOK_OFFLINE")
    System.put_env("EXLA_RS_NOTEBOOK_OFFLINE", @tokenizer_dir)
    Nx.global_default_backend(Nx.BinaryBackend)
    Nx.Defn.global_default_options(compiler: Nx.Defn.Evaluator)

    on_exit(fn ->
      if previous, do: System.put_env("EXLA_RS_NOTEBOOK_OFFLINE", previous), else: System.delete_env("EXLA_RS_NOTEBOOK_OFFLINE")
    end)

    :ok
  end

  test "the notebooks are there" do
    names = Enum.map(@notebooks, &Path.basename/1)
    assert "getting_started.livemd" in names
    assert "bumblebee.livemd" in names
    assert "performance.livemd" in names
  end

  for path <- @notebooks do
    @path path
    test "notebooks/#{Path.basename(path)} runs, cell by cell" do
      run_notebook(@path)
    end
  end

  defp run_notebook(path) do
    name = Path.relative_to(path, @root)
    [setup | cells] = Livemd.cells(path)

    # Livebook's setup cell: the notebook's first cell, and only Mix.install (and its config).
    assert setup.code =~ "Mix.install(", "#{name}: the first cell must be the Mix.install setup cell"
    assert {:ok, _} = Code.string_to_quoted(setup.code), "#{name}: the setup cell does not parse"
    for cell <- cells, do: refute(cell.code =~ "Mix.install(", "#{name} cell #{cell.index}: Mix.install outside the setup cell")

    Nx.default_backend(Nx.BinaryBackend)
    env = Code.env_for_eval(file: path)

    Enum.reduce(cells, {[], env}, fn cell, {binding, env} ->
      started = System.monotonic_time(:millisecond)

      # Its standard output and error (compile errors are logged there), shown on failure.
      {{result, output}, errors} =
        ExUnit.CaptureIO.with_io(:standard_error, fn ->
          ExUnit.CaptureIO.with_io(fn -> eval_cell(path, cell, binding, env) end)
        end)

      output = output <> errors

      ms = System.monotonic_time(:millisecond) - started
      if System.get_env("EXLA_RS_NOTEBOOK_VERBOSE"), do: IO.puts("#{name} cell #{cell.index} (line #{cell.line}): #{ms} ms\n#{output}")

      case result do
        {:ok, binding, env} ->
          {binding, env}

        {:error, error, stacktrace} ->
          message =
            case error do
              {kind, reason} -> Exception.format_banner(kind, reason, stacktrace)
              exception -> Exception.format_banner(:error, exception, stacktrace)
            end

          flunk("""
          #{name}, cell #{cell.index} (the ```elixir block at line #{cell.line}) failed:
          #{message}
          #{Exception.format_stacktrace(Enum.take(stacktrace, 8))}
          its output:
          #{output}
          the cell:
          #{cell.code}
          """)
      end
    end)
  end

  defp eval_cell(path, cell, binding, env) do
    quoted = Code.string_to_quoted!(cell.code, file: path, line: cell.line + 1, columns: true)
    {value, binding, env} = Code.eval_quoted_with_env(quoted, binding, env)
    if System.get_env("EXLA_RS_NOTEBOOK_VERBOSE"), do: IO.puts("=> " <> inspect(value, limit: 12, printable_limit: 200))
    {:ok, binding, env}
  rescue
    error -> {:error, error, __STACKTRACE__}
  catch
    kind, reason -> {:error, {kind, reason}, __STACKTRACE__}
  end
end

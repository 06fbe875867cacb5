// A time-series chart: uPlot on a canvas, sized to its container.
import { useEffect, useRef } from "preact/hooks";
import uPlot from "uplot";

export interface SeriesSpec {
  label: string;
  color: string;
  fmt?: (v: number) => string; // the legend's value
}

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#4b5563"];
export const color = (i: number) => PALETTE[i % PALETTE.length];

// times: unix seconds; values: one array per series, null for no sample.
export function Chart({
  title,
  times,
  series,
  values,
  height = 180,
  testid,
  yFmt,
}: {
  title: string;
  times: number[];
  series: SeriesSpec[];
  values: (number | null)[][];
  height?: number;
  testid?: string;
  yFmt?: (v: number) => string;
}) {
  const box = useRef<HTMLDivElement>(null);
  const plot = useRef<uPlot | null>(null);
  const shape = series.map((s) => s.label).join("\u0000");

  useEffect(() => {
    const el = box.current!;
    const opts: uPlot.Options = {
      width: Math.max(200, el.clientWidth),
      height,
      legend: { live: true },
      cursor: { drag: { x: true, y: false } },
      scales: { x: { time: true }, y: { range: (_u, min, max) => [Math.min(0, min ?? 0), Math.max(1, (max ?? 1) * 1.1)] } },
      axes: [
        { stroke: "#6b7280", grid: { stroke: "#eef0f3" } },
        {
          stroke: "#6b7280",
          grid: { stroke: "#eef0f3" },
          size: yFmt ? 78 : 50,
          values: yFmt ? (_u, vals) => vals.map((v) => (v === null ? "" : yFmt(v))) : undefined,
        },
      ],
      series: [
        {},
        ...series.map((s) => ({
          label: s.label,
          stroke: s.color,
          width: 1.5,
          fill: s.color + "14",
          spanGaps: false,
          points: { show: false },
          value: s.fmt ? (_u: uPlot, v: number | null) => (v === null ? "–" : s.fmt!(v)) : undefined,
        })),
      ],
    };
    plot.current = new uPlot(opts, [times, ...values] as uPlot.AlignedData, el);
    const ro = new ResizeObserver(() => {
      const w = Math.max(200, el.clientWidth);
      if (plot.current && Math.abs(plot.current.width - w) > 2) plot.current.setSize({ width: w, height });
    });
    ro.observe(el);
    return () => {
      ro.disconnect();
      plot.current?.destroy();
      plot.current = null;
    };
    // The chart is rebuilt only when its series change; data goes through setData.
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [shape, height]);

  useEffect(() => {
    plot.current?.setData([times, ...values] as uPlot.AlignedData);
  }, [times, values]);

  return (
    <div class="chart" data-testid={testid} data-points={times.length}>
      <div class="chart-title">{title}</div>
      <div ref={box} class="chart-canvas" />
      {times.length < 2 ? <div class="muted small">collecting samples…</div> : null}
    </div>
  );
}

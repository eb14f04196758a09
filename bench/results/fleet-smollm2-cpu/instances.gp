set terminal pngcairo size 1400,560 font 'sans,10'
set output 'bench/results/fleet-smollm2-cpu/instances.png'
set grid
set key outside right top
set datafile separator ','
set multiplot layout 1,3
set xlabel 'instances'
set logscale y
set ylabel 'p99 TTFT (ms)'
set title 'p99 time to first token'
plot 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==0.5?$1:1/0):9 with linespoints title 'rate 0.5', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==1?$1:1/0):9 with linespoints title 'rate 1', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==2?$1:1/0):9 with linespoints title 'rate 2', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==4?$1:1/0):9 with linespoints title 'rate 4', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==8?$1:1/0):9 with linespoints title 'rate 8', 2000 with lines dt 2 lc rgb 'red' title 'target'
set ylabel 'p99 ITL (ms)'
set title 'p99 inter-token latency'
plot 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==0.5?$1:1/0):11 with linespoints title 'rate 0.5', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==1?$1:1/0):11 with linespoints title 'rate 1', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==2?$1:1/0):11 with linespoints title 'rate 2', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==4?$1:1/0):11 with linespoints title 'rate 4', 'bench/results/fleet-smollm2-cpu/instances.csv' skip 1 using ($2==8?$1:1/0):11 with linespoints title 'rate 8', 300 with lines dt 2 lc rgb 'red' title 'target'
unset logscale y
set xlabel 'offered load (req/s)'
set ylabel 'instances'
set title 'instances needed'
plot 'bench/results/fleet-smollm2-cpu/needed.csv' skip 1 using 1:2 with linespoints title 'fewest meeting the targets'
unset multiplot

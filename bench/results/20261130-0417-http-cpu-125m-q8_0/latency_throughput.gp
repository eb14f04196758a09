set terminal pngcairo size 1400,648 font 'sans,10'
set output 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.png'
set grid
set key outside right top
set multiplot layout 1,2 title 'Intel(R) Xeon(R) Processor (cpu): latency against output throughput (p50 dashed, p99 solid; points in order of offered load)'
set xlabel 'output tokens/s'
set logscale y
set key outside below font ',8' maxcols 1
set datafile missing 'nan'
set title 'TTFT'
set ylabel 'TTFT (ms)'
unset arrow
unset label
set arrow from graph 0, first 2000 to graph 1, first 2000 nohead dt 3 lc rgb 'red'
set label 'target 2000 ms' at graph 0.02, first 2000 offset 0,0.6 tc rgb 'red'
set label 'operating point' at first 180.131, first 441.946 right point pt 6 ps 3 lc rgb 'black' offset -1,1
plot 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 0 using 1:2 with linespoints lc 1 dt 2 pt 7 notitle, 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 0 using 1:3 with linespoints lc 1 dt 1 pt 5 title 'batch\_timeout\_ms=2 max\_batch\_seqs=1', 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 1 using 1:2 with linespoints lc 2 dt 2 pt 7 notitle, 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 1 using 1:3 with linespoints lc 2 dt 1 pt 5 title 'batch\_timeout\_ms=2 max\_batch\_seqs=16'
set title 'ITL'
set ylabel 'ITL (ms)'
unset arrow
unset label
set arrow from graph 0, first 150 to graph 1, first 150 nohead dt 3 lc rgb 'red'
set label 'target 150 ms' at graph 0.02, first 150 offset 0,0.6 tc rgb 'red'
set label 'operating point' at first 180.131, first 14.7695 right point pt 6 ps 3 lc rgb 'black' offset -1,1
plot 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 0 using 1:4 with linespoints lc 1 dt 2 pt 7 notitle, 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 0 using 1:5 with linespoints lc 1 dt 1 pt 5 title 'batch\_timeout\_ms=2 max\_batch\_seqs=1', 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 1 using 1:4 with linespoints lc 2 dt 2 pt 7 notitle, 'bench/results/20261130-0417-http-cpu-125m-q8_0/latency_throughput.dat' index 1 using 1:5 with linespoints lc 2 dt 1 pt 5 title 'batch\_timeout\_ms=2 max\_batch\_seqs=16'
unset multiplot
